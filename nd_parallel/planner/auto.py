"""The top plan for the ranks actually launched, as ParallelismConfig keyword arguments (`layout: auto`)."""

from __future__ import annotations

import dataclasses
import os

from .entry import plan
from .errors import PlannerError
from .layout import Cluster, Training
from .search import Constraints, Plan
from .units import parse_bytes


def local_memory(device: str, ranks_per_node: int) -> int:
    """Bytes one rank may use: the GPU's memory, or this machine's RAM shared by its CPU ranks."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise PlannerError("cannot read this machine's memory; pass gpu_memory='64GiB' (bytes per rank)") from None
    return total // max(ranks_per_node, 1)


def top_plan(model, *, world_size: int, seq_len: int, global_batch: int, gpus_per_node: int | None = None,
             gpu_memory: int | str | None = None, dtype: str = "bf16", lora_rank: int | None = None,
             device: str | None = None, constraints: Constraints = Constraints(), **cluster: float) -> Plan:
    """The fastest plan for `world_size` ranks; PlannerError (with the hint) when none fits. `model`: whatever
    `plan` takes (a path, a module or a ModelSpec)."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    per_node = gpus_per_node or world_size
    if world_size % per_node:
        raise PlannerError(f"world_size={world_size} is not a multiple of gpus_per_node={per_node}")
    memory = parse_bytes(gpu_memory, "gpu_memory") if gpu_memory is not None else local_memory(device, per_node)
    result = plan(model, Training(seq_len=seq_len, global_batch=global_batch, dtype=dtype, lora_rank=lora_rank),
                  Cluster(nodes=world_size // per_node, gpus_per_node=per_node, gpu_memory=memory, device=device,
                          **cluster), constraints)
    if not result.plans:
        raise PlannerError(result.hint)
    return result.plans[0]


def config_kwargs(plan: Plan, fields: set[str]) -> dict:
    """ParallelismConfig keyword arguments of a plan (`fields`: the names the config class has)."""
    lay = plan.layout
    out = dict(lay.sizes())
    if lay.pp > 1:
        out.update(pp_schedule=lay.schedule, pp_microbatches=lay.microbatches, pp_virtual_stages=lay.virtual)
    if lay.checkpointing != "none":
        if "activation_checkpointing" not in fields:
            raise PlannerError(f"the top plan needs activation_checkpointing={lay.checkpointing!r}, which this "
                               "version of ParallelismConfig does not have; pin checkpointing='none' or more memory")
        out["activation_checkpointing"] = lay.checkpointing
    return out


def fields_of(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
