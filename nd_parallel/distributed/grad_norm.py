"""Gradient-norm clipping that returns the true global norm over every parallel dimension."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _local_and_groups(grad: torch.Tensor):
    """The local data of a gradient and the process groups over which its shards must be combined.

    A DTensor is summed over the mesh dims where it is sharded; dims where it is replicated hold copies and
    must not be counted twice. Plain tensors are whole on this rank.
    """
    if not isinstance(grad, DTensor):
        return grad, ()
    if any(p.is_partial() for p in grad.placements):  # pending sums: materialise them before squaring
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    mesh = grad.device_mesh
    # Every placement other than Replicate splits the tensor (Shard, and FSDP's _StridedShard over a
    # TP-sharded dim, whose is_shard() is False), so its pieces add up.
    groups = tuple(mesh.get_group(i) for i, p in enumerate(grad.placements) if not p.is_replicate())
    return grad.to_local(), groups


def total_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, extra_group=None,
               exclude: set[int] = frozenset()) -> torch.Tensor:
    """Global p-norm of the gradients of ``parameters``; ``extra_group`` adds ranks holding other params (pp)."""
    norm_type = float(norm_type)
    buckets: dict[tuple, list] = {}
    device = None
    for p in parameters:
        if p.grad is None or id(p) in exclude:
            continue
        local, groups = _local_and_groups(p.grad)
        device = local.device
        key = tuple(dist.get_process_group_ranks(g).__repr__() for g in groups)
        buckets.setdefault(key, [groups, []])[1].append(local)
    if device is None:
        device = torch.device("cpu")
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), device=device, dtype=torch.float32)
    for groups, tensors in buckets.values():
        norms = torch._foreach_norm([t.float() for t in tensors], norm_type)
        part = torch.stack(norms).max() if inf else torch.stack(norms).pow(norm_type).sum()
        for group in groups:
            dist.all_reduce(part, op=op, group=group)
        total = torch.maximum(total, part) if inf else total + part
    if extra_group is not None:
        dist.all_reduce(total, op=op, group=extra_group)
    return total if inf else total.pow(1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, extra_group=None,
    exclude_from_norm: set[int] = frozenset(), check=None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm`` (torch's formula); return the norm.

    ``exclude_from_norm``: ids of parameters that duplicate another one's gradient (a tied weight's second
    copy); they are scaled but not counted. ``check(norm)`` runs before any gradient is scaled.
    """
    parameters = [p for p in parameters if p.grad is not None]
    norm = total_norm(parameters, norm_type, extra_group, exclude_from_norm)
    if check is not None:  # before scaling: a NaN norm would turn every gradient into NaN and hide where it began
        check(norm)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in parameters:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return norm
