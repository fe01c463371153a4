"""The optimizer step's kernels: torch's foreach implementation where the user left the choice to torch.

torch picks its per-parameter ("single tensor") loop by default on CPU and its foreach kernels on CUDA
(``torch.optim.optimizer._default_to_fused_or_foreach``). Under FSDP/TP every parameter is a DTensor, and each
of the per-parameter loop's dozen ops per parameter goes through DTensor's Python dispatch (sharding propagation,
spec hashing): on CPU that dispatch, not the arithmetic, is the optimizer step's cost. The foreach kernels
dispatch once per op for the whole list. For torch's element-wise optimizers both implementations compute the
same numbers (the same formula, op for op; tests/unit/test_optimizer.py checks bit equality for AdamW, Adam and
SGD with momentum). The price is transient memory: a foreach op allocates its result for every tensor of the
list at once (AdamW: one extra copy of this rank's parameter shards during the step), which CUDA users pay by
default already.

Only ``torch.optim`` optimizers and only param groups whose ``foreach`` is ``None`` (torch's "choose for me")
and that are not ``fused`` are changed; an explicit ``foreach=False`` is the user's and stays. A group that mixes
DTensor and plain parameters (DDP-style replication leaves some parameters plain) keeps the per-parameter loop:
DTensor's foreach ops refuse a list that mixes the two. DTensors on different meshes are fine (FSDP's 1-D and
FSDPxTP's 2-D parameters in one group).

A ``fused`` group (transformers' Trainer picks ``adamw_torch_fused`` by default) that mixes the two would fail at its
first step ("aten._fused_adamw_.default got mixed torch.Tensor and DTensor": TP without FSDP leaves LoRA's
replicated factors and the norms plain): it takes the per-parameter loop instead (the same formula), said once.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger("nd_parallel")


def _mixed(group: dict) -> bool:
    return len({isinstance(p, DTensor) for p in group["params"]}) > 1


def prefer_foreach(optimizer: torch.optim.Optimizer) -> int:
    """Set ``foreach=True`` on the param groups that left it to torch; returns how many groups changed. A fused
    group mixing DTensors and plain tensors is unfused (module docstring)."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return 0
    unfused = [g for g in optimizer.param_groups if g.get("fused") and _mixed(g)]
    for group in unfused:
        group["fused"], group["foreach"] = False, False
    if unfused:
        logger.info("optimizer %s: fused=True on %d param group(s) mixing DTensor and plain parameters, which its "
                    "fused kernel refuses: torch's per-parameter loop instead (the same update)",
                    type(optimizer).__name__, len(unfused))
    changed = 0
    for group in optimizer.param_groups:
        if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
            continue
        if any(p.is_sparse or p.device.type != "cpu" for p in group["params"]):
            continue  # CUDA: torch chooses foreach itself; sparse tensors have no foreach kernels
        if _mixed(group):
            continue  # DTensor's foreach ops refuse a list mixing DTensors and plain tensors
        group["foreach"] = True
        changed += 1
    if changed:
        logger.debug("optimizer %s: torch's foreach kernels on %d param group(s) (foreach was unset)",
                     type(optimizer).__name__, changed)
    return changed
