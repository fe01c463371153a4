"""What the bf16 rows of test_train_modes.py compare against, and how they see the dtype a layout computed in.

- ``train_plain``: one process without nd_parallel. fp32 is transformers' model trained as it is; bf16 is torch's own
  mixed-precision recipe written out here: ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` over a one-rank mesh, once per decoder layer and once at the root (what torchtitan does).
  The layouts are thus checked against torch, not against nd_parallel's own one-rank recipe. fp16 is the same with
  ``param_dtype=float16`` and torch's ``GradScaler("cpu")`` used as torch documents it (scale, unscale_, clip,
  step, update), the LR schedule skipping a skipped step as Accelerate's does.
- ``ComputeDtypes``: forward pre-hooks on the Linears inside the decoder layers record the dtypes of the matmul's
  input and weight as they reach the kernel, so "computed in bf16" is observed, not inferred from the loss.
"""

from __future__ import annotations

import torch
from torch import nn

from nd_parallel.testing.parity import EvalResult, Recipe, RunResult, _collate, train_reference


def train_plain(model_dir, samples, recipe: Recipe, mixed_precision: str,
                eval_samples=None, scaler_kwargs=None) -> tuple[RunResult, set[str]]:
    """One process, global batch = ``recipe.per_rank_batch``; bf16 needs a (one-rank) process group. Returns the
    run (with the logits of ``eval_samples`` before training, if given) and the dtypes its decoder layers'
    matmuls saw (``ComputeDtypes``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    probe = ComputeDtypes(model)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if mixed_precision in dtypes:
        mesh = init_device_mesh("cpu", (1,))
        policy = MixedPrecisionPolicy(param_dtype=dtypes[mixed_precision], reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    elif mixed_precision != "no":
        raise ValueError(f"mixed_precision={mixed_precision!r}: the plain reference runs 'no', 'bf16' or 'fp16'")
    before = _evaluate(model, eval_samples, recipe.per_rank_batch) if eval_samples is not None else None
    with probe:
        scaler = torch.amp.GradScaler("cpu", **(scaler_kwargs or {})) if mixed_precision == "fp16" else None
        result = train_reference(model_dir, samples, 1, recipe, model=model, scaler=scaler)
    result.evals = [before] if before is not None else []
    result.state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in result.state.items()}
    result.model = model
    return result, probe.seen


def _evaluate(model, samples, batch_size: int) -> EvalResult:
    """What ``parity.evaluate`` records, for a model without an Accelerator: loss per batch, fp32 logits."""
    model.eval()
    losses, logits = [], []
    with torch.no_grad():
        for i in range(0, len(samples), batch_size):
            out = model(**_collate(samples[i:i + batch_size]))
            losses.append(out.loss.item())
            logits.append(out.logits.float())
    model.train()
    if hasattr(model, "reshard"):
        # FSDP2 leaves the root's parameters unsharded after a forward (they are needed first in backward), and
        # model.parameters() would then hand the optimizer built next those temporary bf16 copies.
        model.reshard()
    return EvalResult(0, losses, torch.cat(logits), out.logits.dtype)


class ComputeDtypes:
    """``with ComputeDtypes(model) as probe: ...``: ``probe.seen`` = {"input <dtype>", "weight <dtype>"} over every
    call of a Linear inside a decoder layer (a module whose name contains ``.layers.``) of ``model``."""

    def __init__(self, model: nn.Module):
        self.linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in name]
        self.seen: set[str] = set()
        self.handles = []

    def _record(self, module, args, kwargs):
        self.seen.add(f"input {args[0].dtype}" if args else f"input {kwargs['input'].dtype}")
        self.seen.add(f"weight {module.weight.dtype}")

    def __enter__(self):
        self.seen.clear()
        self.handles = [m.register_forward_pre_hook(self._record, with_kwargs=True) for m in self.linears]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
