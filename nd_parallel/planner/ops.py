"""How many tensor ops a training step dispatches, counted on the real model: the per-op overhead the time model adds.

On small models (and on CPU ranks) a step is bounded by dispatch, not arithmetic: every aten op pays a fixed
Python/dispatcher cost, an op on a DTensor pays DTensor's sharding propagation on top, and every collective pays its
latency. The counts come from running the model, never from a per-family table:
- one decoder layer's forward and backward: the causal LM built on the meta device with one and with two layers
  (same config otherwise), one forward + backward each under a counting dispatch mode; the difference is one
  layer, the one-layer run minus it is the embedding, final norm, head and loss;
- the same with a LoRA adapter on the targeted Linears (PEFT's wrappers, when peft is installed);
- each Linear/Embedding a TP plan shards, alone, forward + backward: those ops run on DTensors under TP;
- one ring-attention step of our CP kernel on a tiny CPU shard (its block planning is data dependent);
- one AdamW step on one parameter (the for-loop implementation torch uses on CPU) and on a list (foreach, CUDA).
Shapes do not change the counts (tiny inputs: batch 1, 8 tokens).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from nd_parallel.models.hf import text_config

from .meta import meta_model

TOKENS = 8


class _Count(TorchDispatchMode):
    """Counts the aten ops dispatched while active (each op once: the ops DTensor or autograd run inside are not
    seen twice)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class OpCounts:
    """Aten ops per micro-batch of one decoder layer and of the rest of the model, forward and backward."""

    layer_fwd: int
    layer_bwd: int
    rest_fwd: int
    """Embedding, final norm, head and loss (forward)."""
    rest_bwd: int
    lora_layer_fwd: int
    """One layer with the LoRA adapter (frozen base: no weight-gradient matmuls); equal to layer_fwd without peft."""
    lora_layer_bwd: int
    tp_layer: int
    """Of layer_fwd + layer_bwd, the ops inside the Linears the TP plan shards (they run on DTensors under TP)."""
    tp_rest: int
    """The same for the sharded embedding and head."""
    ring_diagonal: int
    """The CP ring's step on the rank's own K/V, forward + backward, one layer: three blocks of the load-balanced
    layout (two causal triangles and the full pair between them)."""
    ring_off_diagonal: int
    """Each of the cp-1 other steps: the visible half of a shard pair, one merged full block."""
    adam_tensor: int
    """AdamW ops per parameter tensor per step that touch the parameter, its gradient or its state (the for-loop
    implementation torch runs on CPU); they run on DTensors when the parameters are DTensors."""
    adam_scalar: int
    """The rest of them (the step counter): plain ops."""
    adam_foreach: int
    """AdamW ops per step per parameter list (foreach: CUDA)."""

    @classmethod
    def none(cls) -> "OpCounts":
        return cls(*(0,) * len(fields(cls)))


def _fwd_bwd(model: nn.Module, inputs: dict) -> tuple[int, int]:
    fwd, bwd = _Count(), _Count()
    with fwd:
        loss = model(**inputs).loss
    with bwd:
        loss.backward()
    return fwd.n, bwd.n


def _supports_sdpa(config) -> bool:
    from transformers import AutoModelForCausalLM

    try:
        return getattr(AutoModelForCausalLM._model_mapping[type(config)], "_supports_sdpa", True)
    except KeyError:
        return True


def _with_layers(config, n: int):
    cfg = copy.deepcopy(config)
    text = text_config(cfg)
    text.num_hidden_layers = n
    if isinstance(getattr(text, "layer_types", None), list):  # per-layer attention kinds: keep the first n
        text.layer_types = text.layer_types[:n]
    cfg._attn_implementation = "sdpa" if _supports_sdpa(cfg) else "eager"  # gpt-oss (attention sinks): eager only
    # Stacked experts (MoE): the default grouped-mm kernel takes bf16 only, and the eager loop over the experts hit is
    # data dependent (nonzero), which meta cannot run; the batched kernel runs every token's top-k experts as one
    # gather + bmm, on meta. The counts are per-op overhead only: close enough for the grouped kernel too.
    if getattr(text, "_experts_implementation", None) is not None or hasattr(text, "num_experts_per_tok"):
        cfg._experts_implementation = text._experts_implementation = "batched_mm"
    return cfg


def _lora(model: nn.Module, targets: tuple[str, ...] | None) -> nn.Module | None:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return None
    with warnings.catch_warnings():  # transformers' MoE conversion patterns that this tiny adapter does not use
        warnings.simplefilter("ignore", RuntimeWarning)
        return get_peft_model(model, LoraConfig(r=2, lora_dropout=0.0, target_modules=list(targets) if targets
                                                else "all-linear"))


def _module_ops(module: nn.Module) -> int:
    """Forward + backward ops of one Linear (input [1, TOKENS, in]) or Embedding, alone on meta."""
    if isinstance(module, nn.Embedding):
        x = torch.zeros(1, TOKENS, dtype=torch.long, device="meta")
    else:
        x = torch.zeros(1, TOKENS, module.in_features, device="meta", requires_grad=True)
    fwd, bwd = _Count(), _Count()
    with fwd:
        y = module(x).sum()
    with bwd:
        y.backward()
    return fwd.n + bwd.n - 2  # the sum and its backward are ours, not the module's


def _ring_step(causal: bool) -> int:
    """Forward + backward ops of our CP attention on one 8-token shard against itself: the diagonal step
    (causal, three blocks) or, without the causal mask, one full block (an off-diagonal step)."""
    from nd_parallel.distributed.context_parallel.blocks import KVMeta
    from nd_parallel.distributed.context_parallel.ring import local_attention

    q = torch.randn(1, 2, TOKENS, 4, requires_grad=True)
    k, v = (torch.randn(1, 1, TOKENS, 4, requires_grad=True) for _ in range(2))
    fwd, bwd = _Count(), _Count()
    with fwd:
        out = local_attention(q, k, v, KVMeta(torch.arange(TOKENS)), scale=0.5, causal=causal).sum()
    with bwd:
        out.backward()
    return fwd.n + bwd.n - 2


class _CountShaped(_Count):
    """Counts, separately, the ops with an argument of `numel` elements (a parameter, its gradient or state)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.shaped = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        self.shaped += any(isinstance(t, torch.Tensor) and t.numel() == self.numel for t in flat)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _adam(foreach: bool) -> tuple[int, int]:
    """(ops touching the parameter/grad/state, the others) of one AdamW step on one 4-element parameter."""
    p = nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=foreach)
    p.grad = torch.zeros(4)
    opt.step()  # creates the state
    count = _CountShaped(4)
    with count:
        opt.step()
    return count.shaped, count.n - count.shaped


def count_ops(config, tp_modules: list[nn.Module], tp_rest: list[nn.Module],
              lora_targets: tuple[str, ...] | None = None) -> OpCounts:
    """OpCounts of the causal LM `config` describes; `tp_modules` are one layer's TP-planned modules and `tp_rest`
    the TP-planned embedding/head (meta modules of the full model)."""
    ids = torch.zeros(1, TOKENS, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids}
    one, two = (_fwd_bwd(meta_model(_with_layers(config, n)), inputs) for n in (1, 2))
    layer = (two[0] - one[0], two[1] - one[1])
    lora_one, lora_two = (None, None)
    peft_one = _lora(meta_model(_with_layers(config, 1)), lora_targets)
    try:
        if peft_one is not None:
            lora_one = _fwd_bwd(peft_one, inputs)
            lora_two = _fwd_bwd(_lora(meta_model(_with_layers(config, 2)), lora_targets), inputs)
    except RuntimeError:  # PEFT's wrapper of stacked expert weights opens autocast on the tensors' device: not on
        lora_one = None  # meta (peft 0.21). The adapter's few ops per layer are then left out, the base's counted.
    lora = (lora_two[0] - lora_one[0], lora_two[1] - lora_one[1]) if lora_one else layer
    return OpCounts(layer_fwd=layer[0], layer_bwd=layer[1], rest_fwd=one[0] - layer[0], rest_bwd=one[1] - layer[1],
                    lora_layer_fwd=lora[0], lora_layer_bwd=lora[1],
                    tp_layer=sum(_module_ops(m) for m in tp_modules), tp_rest=sum(_module_ops(m) for m in tp_rest),
                    ring_diagonal=_ring_step(True), ring_off_diagonal=_ring_step(False),
                    adam_tensor=_adam(False)[0], adam_scalar=_adam(False)[1], adam_foreach=sum(_adam(True)))
