"""bitsandbytes' 8-bit optimizers (AdamW8bit, PagedAdamW8bit, ...) on sharded (DTensor) parameters.

Their kernels take plain tensors. Each rank's DTensor parameter is a local shard plus a placement, and the optimizer
is element-wise apart from its state's block-wise quantization, so each rank can step its own shard: the optimizer
is re-pointed to plain parameters that share storage with the local shards (an in-place update of one is an update
of the other), and each step hands them the local shards of the DTensor gradients. No collective is involved.

How this differs from one process, and the tolerance that follows. bitsandbytes keeps each 8-bit state (Adam's
m and v) as uint8 codes with one fp32 absmax per block of 256 consecutive values of the *flattened* tensor, and
keeps fp32 state for tensors under ``min_8bit_size`` (4096) values. On a shard:
- the 8-bit/32-bit choice is made from the whole tensor's size, as one process makes it (a per-parameter override
  of ``min_8bit_size``), not from the shard's smaller one;
- the blocks are the shard's. Where the shard is a run of the flattened tensor starting at a multiple of 256 and
  ending at one (or at the tensor's end) -- a dim-0 shard (FSDP2, TP colwise) of a tensor whose rows-per-rank x
  row length is a multiple of 256 -- every block holds exactly the values it holds in one process, with the same
  absmax, so the codes, the state and the update are bit-equal: parity at the fp32 tolerances of torch's AdamW.
- Otherwise (a TP row-wise shard, an uneven split) a block groups other values, its absmax differs, and each state
  value is rounded to a different point of the 8-bit dynamic map: the two runs differ by at most one quantization
  step of that map per state value per step (relative to the block's absmax), the same size as the error 8-bit
  state already has against fp32 Adam. Not bit-equal; ``shard_alignment`` says which case a parameter is in.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

BLOCK = 256  # bitsandbytes' block size for 8-bit optimizer state (Optimizer2State.init_state)


def is_bnb_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("bitsandbytes")


def shard_alignment(param: DTensor) -> bool:
    """True where this rank's shard is a run of the flattened tensor whose ends fall on 256-value blocks."""
    local = param.to_local()
    if local.numel() == param.numel():
        return True
    shards = [p for p in param.placements if p.is_shard()]
    if len(shards) != 1 or shards[0].dim != 0:
        return False
    row = param.numel() // max(param.shape[0], 1)
    return (local.shape[0] * row) % BLOCK == 0 or local.numel() == 0


def step_local_shards(optimizer: torch.optim.Optimizer) -> int:
    """Make a bitsandbytes optimizer step the local shards of its DTensor parameters; returns how many."""
    if not is_bnb_optimizer(optimizer):
        return 0
    pairs = []
    min_size = getattr(getattr(optimizer, "args", None), "min_8bit_size", 4096)
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if not isinstance(p, DTensor):
                continue
            local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
            group["params"][i] = local
            # 8-bit or fp32 state as one process would choose it for the whole tensor, not for the shard.
            optimizer.mng.pid2config[id(local)] = {"min_8bit_size": 0 if p.numel() >= min_size else p.numel() + 1}
            pairs.append((p, local))
    if not pairs:
        return 0
    step, zero_grad = optimizer.step, optimizer.zero_grad

    def local_step(*args, **kwargs):
        for p, local in pairs:  # FSDP2 may re-point its shard's storage between steps: alias it again each time
            local.data = p.to_local().detach()
            local.grad = None if p.grad is None else p.grad.to_local().detach()
        return step(*args, **kwargs)

    def local_zero_grad(set_to_none: bool = True):
        for p, local in pairs:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)
            local.grad = None
        return zero_grad(set_to_none)

    optimizer.step, optimizer.zero_grad = local_step, local_zero_grad
    optimizer.nd_parallel_local_shards = pairs  # the DTensor -> stepped local parameter map, for state access
    return len(pairs)


def refuse_checkpoint(optimizers, what: str) -> None:
    """``save_state`` / ``load_state`` with an optimizer stepping local shards: refused, on every rank alike and
    before any collective. Its state is keyed to the per-rank plain parameters, which torch's distributed state dict
    cannot map back to the model's DTensor parameters (nor reshard to another layout)."""
    stepped = [type(o).__name__ for o in optimizers if getattr(o, "nd_parallel_local_shards", None)]
    if stepped:
        raise NotImplementedError(
            f"accelerator.{what}: {stepped[0]} steps each rank's parameter shards (bitsandbytes' 8-bit optimizers "
            "on a sharded layout), and its state cannot be written to or read from a sharded checkpoint yet; use "
            "torch.optim.AdamW (optim: adamw_torch) to checkpoint the optimizer, or save the model only "
            "(accelerator.save_model)")
