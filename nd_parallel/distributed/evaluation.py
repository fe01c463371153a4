"""Evaluation helpers: gathering per-sample results over the data-parallel ranks only.

Accelerate's ``gather`` / ``gather_for_metrics`` collect from every process. Under tp, cp or pp several processes
hold the *same* samples (and, after an evaluation forward, the same logits), so a world-wide gather would repeat
each sample tp·cp·pp times. Here each rank gathers over its data-parallel group, which holds each sample once,
in the order Accelerate's sharded dataloader dealt them; ``gather_for_metrics`` then drops the duplicated tail of
the last batch exactly as Accelerate does (its remainder is computed for dp ranks, see data.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor[None]
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor, group=group)
    return torch.cat(pieces, dim=0)


def gather_over(data, group):
    """Every tensor in a nested list/tuple/dict structure, concatenated over ``group`` along dim 0."""
    from accelerate.utils import recursively_apply

    return recursively_apply(_gather_tensor, data, group, error_on_other_type=True)


def gather_objects_over(objects: list, group) -> list:
    """Picklable per-rank lists concatenated over ``group`` (Accelerate's ``gather_object`` on the dp ranks)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, list(objects), group=group)
    return [item for part in out for item in part]
