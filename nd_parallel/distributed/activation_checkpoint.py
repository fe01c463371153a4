"""Activation checkpointing per decoder layer: "full" (recompute the layer) or "selective" (recompute cheap ops).

Why our own wrapper and not transformers' ``gradient_checkpointing_enable``: how transformers hooks the
checkpoint into its layers moved between 5.16 and 5.24 (``__call__`` override, then a ``forward`` wrapper) and its
default is the reentrant checkpoint, which does not compose with FSDP2 and DTensor parameters. torch's
``checkpoint_wrapper`` would rename every parameter (``_checkpoint_wrapped_module.``), breaking the promise that
names stay the HF names. So the layer keeps its module and its name; only its ``forward`` is replaced, on the
instance, by a non-reentrant ``torch.utils.checkpoint.checkpoint`` of the original. FSDP2's hooks run in
``__call__``, outside the checkpointed region, so recomputation re-runs the layer's math, not its all-gathers.

- ``"full"``: a layer keeps only its inputs; backward re-runs its whole forward. Saved bytes per layer:
  ~2·b·s·h in bf16 (the hidden-state input), whatever the layer computes.
- ``"selective"``: torch's op-level selective checkpointing (``create_selective_checkpoint_contexts``). Outputs
  of matmuls and attention kernels are kept, everything cheap to recompute (norms, activation functions, rotary
  embeddings, residual adds, dtype casts) is recomputed. It keeps most of the FLOPs saved and drops the many
  elementwise intermediates that dominate a gated MLP's and a norm's saved bytes.
  Under TP a rowwise linear's output, a partial sum whose only reader is its reduction (all-reduce, or
  reduce-scatter under sequence parallelism), is recomputed rather than kept (``_partial_sum``: backward needs
  the matmul's inputs, never that output); the reduction's output is kept. Sequence parallelism's region gathers
  are one custom op outside the communication namespaces (sequence_parallel_comm.py), so they are recomputed too:
  backward re-gathers the region input from the saved shard, as Megatron's SP linears do. Selective + SP then holds
  less than selective alone (docs/benchmarks.md), which is why "auto" keeps SP on under it.
- ``every``: checkpoint only every k-th owned layer (k=1: all), the layer-level knob to trade memory for time.

Context parallelism: the ring / Ulysses attention runs inside the recomputed region and **recomputation re-runs
its communication**, under both modes: every cp rank recomputes the same layer at the same point of the backward,
so the P2P pattern matches. (Under "selective" the kernels run with dispatch modes off, see
context_parallel/hf.py: SAC never caches half of a ring's sends.) The CP runtime (group, how the sequence was cut)
lives in a context variable; the recomputation replays the layer in a copy of the context taken at forward time.
"""

from __future__ import annotations

import contextvars
import functools
import logging

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nd_parallel.config import check_activation_checkpointing
from nd_parallel.models.hf import decoder_layers

from .compile import CompiledForward

logger = logging.getLogger(__name__)

_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")  # names across families/versions

_aten = torch.ops.aten
# Ops whose outputs "selective" keeps: the expensive ones (O(b·s·h²) or attention), plus communication, whose
# recomputation would re-run a collective.
_SAVE = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_mm.default,
}
for _name in ("_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"):
    if hasattr(_aten, _name):
        _SAVE.add(getattr(_aten, _name).default)


def _is_communication(func) -> bool:
    namespace = getattr(func, "namespace", "")
    return namespace in ("_c10d_functional", "c10d_functional", "_dtensor", "c10d")


# Matmuls seen with DTensor operands (the policy runs above DTensor's dispatch) and where their left operand is.
_MATMULS = {_aten.mm.default: 0, _aten.bmm.default: 0, _aten.addmm.default: 1, _aten.baddbmm.default: 1}


def _partial_sum(func, args) -> bool:
    """Whether a matmul's output is a partial sum over tensor-parallel ranks: its contraction dim is sharded (a
    rowwise linear). Its only consumer is the reduction (reduce-scatter under SP, all-reduce without), whose own
    output is saved, and backward needs the matmul's inputs, never its output: keeping it would hold a
    full-sequence tensor per rowwise linear for nothing (under SP more than the stream SP splits)."""
    at = _MATMULS.get(func)
    x = args[at] if at is not None and len(args) > at else None
    return isinstance(x, DTensor) and any(p.is_shard(x.ndim - 1) for p in x.placements)


def _policy(ctx, func, *args, **kwargs):
    if _is_communication(func) or (func in _SAVE and not _partial_sum(func, args)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


class CheckpointedForward:
    """Stands in for a layer's ``forward``: runs the original under a non-reentrant checkpoint while training."""

    def __init__(self, forward, mode: str):
        self.forward = forward
        self.mode = mode
        self.context_fn = _selective_context if mode == "selective" else None

    def __call__(self, *args, **kwargs):
        return self.run(self.forward, *args, **kwargs)

    def run(self, forward, *args, **kwargs):
        """Run ``forward`` (the layer's, or a wrapper of it: memory.py's offloading) as this checkpoint does."""
        if not torch.is_grad_enabled():  # evaluation / generation: nothing to save, run as is (KV cache too)
            return forward(*args, **kwargs)
        # A KV cache written inside the region would be written again by the recomputation (and attend to the
        # duplicated keys); training has no use for it, so the checkpointed layer runs without one.
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        extra = {"context_fn": self.context_fn} if self.context_fn is not None else {}
        # The recomputation runs later, inside backward, where context variables set around this forward (the
        # context-parallel runtime: process group, how the sequence was cut) are gone: replay it in a copy of
        # the context as it is now.
        run_in_context = functools.partial(contextvars.copy_context().run, forward)
        return checkpoint(run_in_context, *args, use_reentrant=False, **extra, **kwargs)


def _hf_checkpointing_on(model: nn.Module) -> bool:
    """Whether ``model.gradient_checkpointing_enable()`` was called (the property was renamed in 5.2x)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def requested_mode(model: nn.Module, configured: str | None) -> str | None:
    """The mode to apply: the config's, else "full" when the user called ``model.gradient_checkpointing_enable()``.

    transformers' own flag is turned off here, so a layer is never checkpointed twice.
    """
    check_activation_checkpointing(configured)
    hf_on = _hf_checkpointing_on(model)
    if hf_on:
        for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):  # renamed in 5.2x
            if hasattr(model, name):
                getattr(model, name)()
                break
    return configured or ("full" if hf_on else None)


def check_model(model: nn.Module, mode: str | None) -> None:
    """Refuse checkpointing for a model with no stack of decoder layers to wrap (before any collective)."""
    if mode is None and not _hf_checkpointing_on(model):
        return
    if not decoder_layers(model):
        raise ValueError(
            f"activation_checkpointing={mode or 'full'!r}: {type(model).__name__} has no stack of decoder layers to "
            "checkpoint (no _no_split_modules class and no nn.ModuleList found); use activation_checkpointing=None")


def apply_activation_checkpointing(part: nn.Module, mode: str | None, every: int = 1) -> int:
    """Checkpoint every ``every``-th decoder layer that ``part`` owns, in place. Returns how many were wrapped."""
    if mode is None:
        return 0
    check_activation_checkpointing(mode)
    wrapped = 0
    for i, layer in enumerate(decoder_layers(part)):
        if i % every or isinstance(layer.forward, CheckpointedForward):
            continue
        # The bound method of the class, not an instance attribute another wrapper may have put there first;
        # except the compiled forward (compile=True), which is meant to run inside the checkpoint.
        forward = layer.forward if isinstance(layer.forward, CompiledForward) else functools.partial(
            type(layer).forward, layer)
        layer.forward = CheckpointedForward(forward, mode)
        wrapped += 1
    logger.info("applied %s activation checkpointing to %d layers", mode, wrapped)
    return wrapped
