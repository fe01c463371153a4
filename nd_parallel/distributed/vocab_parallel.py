"""The vocabulary-parallel head and cross-entropy under TP: the logits stay split on the vocabulary, never gathered.

Under TP a causal LM's head is column-parallel over the vocabulary (transformers' plans say
``"lm_head": "colwise_gather_output"`` / ``"colwise_rep"``): each tp rank computes logits for its V/tp slice of
the vocabulary, and the plan's style all-gathers them before HF's loss, so every rank holds the full
[tokens, V] logits again. ``VocabParallelHead`` is that same column-parallel style with the output layout chosen
per call:

- while the chunked loss runs its chunks (``sharded_logits``), the head returns the logits as a DTensor
  ``Shard(-1)`` over the tp mesh; the model's own post-processing (Gemma's soft-cap, Granite's division, Cohere's
  scale) is element-wise and runs on the shards as DTensor ops; the cross-entropy then runs under torch's
  ``loss_parallel`` (``loss_context``): each rank takes its shard's max and sum-exp and its share of the target
  logits, the ranks all-reduce those statistics ([tokens] each), and backward writes softmax - one-hot into the
  local shard. The gradient of the hidden states is a partial sum per rank, all-reduced by the style's input
  conversion, as for any column-parallel Linear;
- every other call (evaluation, ``generate``, a forward without labels, HF's unchunked loss) gets the gathered,
  plain logits, exactly as the plan's style gives them.

Why torch's ``loss_parallel`` and no custom autograd Function: the chunked loss (chunked_loss.py) already reduces
to ``F.cross_entropy(logits [c, V], targets [c], ignore_index=-100, reduction="sum")`` per chunk, with the shift,
the global-token mean and the head's scaling done outside it; that call is exactly what ``loss_parallel``
implements on a 1-D tp mesh (FSDP's all-gathered parameters and the head's output live on the tp mesh alone).

The input layout is a parameter (``head_style(input_layout=...)``): ``Replicate()`` today (the final norm's output
is whole on every tp rank); sequence parallelism passes ``Shard(1)``, and the style all-gathers the sequence before
the matmul as torch's ``ColwiseParallel(input_layouts=Shard(1))`` does. ``tensor_parallel.apply_tp`` is the one
place that picks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

# The plan styles that gather a vocabulary-split head's output: the head entries VocabParallelHead replaces.
GATHERING_HEAD_STYLES = ("colwise_gather_output", "colwise_rep")
_MARK = "_nd_vocab_parallel_head"  # set on the head module by VocabParallelHead
_SHARDED = "_nd_logits_sharded"  # True on the head while the chunked loss asks for sharded logits


class VocabParallelHead(ColwiseParallel):
    """``ColwiseParallel`` over the vocabulary whose output is gathered (a plain tensor, as
    ``colwise_gather_output``) unless the module is inside ``sharded_logits``: then a DTensor ``Shard(-1)``."""

    def __init__(self, *, input_layout: Placement | None = None):
        super().__init__(input_layouts=input_layout or Replicate(), output_layouts=Replicate(), use_local_output=True)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if getattr(mod, _SHARDED, False):
            return outputs  # [b, s, V] as a DTensor: this rank holds [b, s, V/tp]
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        setattr(module, _MARK, True)
        return super()._apply(module, device_mesh)


def head_style(input_layout: Placement | None = None) -> VocabParallelHead:
    """The TP style of a vocabulary-split head; ``input_layout`` is the layout of the hidden states that reach it
    (``Replicate()`` by default; ``Shard(1)`` when sequence parallelism leaves the final norm's output sharded).
    A layout the head cannot take (a partial sum, the hidden dim) is refused before any collective."""
    if input_layout is not None and not (input_layout.is_replicate() or
                                         (isinstance(input_layout, Shard) and input_layout.dim in (0, 1))):
        raise ValueError(f"the vocabulary-parallel head's input layout {input_layout} is not one it can take; pass "
                         "Replicate() (whole hidden states on every tp rank) or Shard(1) (sequence-sharded, as "
                         "sequence parallelism leaves them)")
    return VocabParallelHead(input_layout=input_layout)


def vocab_parallel_heads(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``VocabParallelHead`` split (none without TP, or with a replicated head)."""
    return [m for m in model.modules() if getattr(m, _MARK, False)]


@contextlib.contextmanager
def sharded_logits(heads: list[nn.Module]) -> Iterator[None]:
    """Inside: the given heads return vocabulary-sharded DTensor logits instead of gathering them."""
    for head in heads:
        setattr(head, _SHARDED, True)
    try:
        yield
    finally:
        for head in heads:
            setattr(head, _SHARDED, False)


def loss_context(logits: torch.Tensor):
    """``loss_parallel`` where the logits are vocabulary-sharded; nothing for plain logits. The backward of the
    cross-entropy must run inside it too (torch's rule)."""
    return loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (``loss_parallel``'s sum over a 1-D tp mesh) as the plain tensor it equals."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
