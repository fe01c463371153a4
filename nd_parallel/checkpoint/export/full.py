"""``accelerator.save_model`` and ``accelerator.get_state_dict`` of a full (non-adapter) model.

Every rank takes part; the main process writes (or returns the state dict).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from nd_parallel.models.peft import with_peft_names

from ..names import MODEL, hf_modules, named_state
from ..train_state import TrainState
from .gather import entries, gather_one_by_one
from .writer import ShardedWriter, shard_size, write_model_config

logger = logging.getLogger("nd_parallel")


def save_full(state: TrainState, model: nn.Module, out_dir: Path, max_shard_size) -> Path:
    """HF safetensors + config.json of the whole model, gathered and written one tensor at a time."""
    local = {k[len(MODEL) + 1:]: v for k, v in named_state(model).flat.items()}
    order, holders = entries(local, state.distributed)
    writer = None
    if state.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        writer = ShardedWriter(out_dir, order, shard_size(max_shard_size))
    for name, tensor in gather_one_by_one(state, local, order, holders):
        writer.write(name, tensor)
    if state.is_main_process:
        files = writer.close()
        write_model_config(hf_modules(model)[1], out_dir)
        logger.info("saved %s (%d tensors in %d files)", out_dir, len(order), len(files))
    state.barrier()
    return out_dir


def full_state_dict(state: TrainState, model: nn.Module, mesh) -> dict[str, torch.Tensor]:
    """Full, unsharded, HF-named state dict on the main process (an empty dict on the others).

    ``mesh``: the run's ParallelMesh, or None where nothing was sharded (one process in fp32)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized() or (state.num_processes == 1 and mesh is None):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if state.config.pp_size == 1:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(model, options=options)
        return full if state.is_main_process else {}
    return with_peft_names(model, _pipeline_state_dict(state, model, mesh))


def _pipeline_state_dict(state: TrainState, model, mesh) -> dict[str, torch.Tensor]:
    """Each stage gathers its full tensors, then the pp ranks send theirs to the main process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    mine = {}
    for stage in model.stages:
        mine.update({k: v.detach().cpu() for k, v in get_model_state_dict(stage, options=options).items()})
    inner_first = all(mesh.local_rank(d) == 0 for d in ("dp_replicate", "dp_shard", "cp", "tp"))
    pieces = [None] * mesh.size("pp") if state.is_main_process else None
    if inner_first:  # one rank per stage sends; pp group of the first dp/cp/tp coordinate
        dist.gather_object(mine, pieces, group=mesh["pp"].get_group(), group_dst=0)
    if not state.is_main_process:
        return {}
    merged = {}
    for piece in pieces:
        merged.update(piece)
    return merged
