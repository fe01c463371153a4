"""The one place that decides the order in which parallelisms are applied to a model.

Per model part — the whole model, or each pipeline stage — ``parallelize_part`` applies, in this order:

1. **TP**: it must see plain ``nn.Linear`` weights to split them.
2. **Activation checkpointing**: it wraps each decoder layer's ``forward``; placed after TP so the recomputed
   region contains TP's (functional) collectives, and before FSDP so FSDP's all-gather hooks stay *outside* the
   region and are not repeated by the recomputation.
3. **FSDP / HSDP with the precision policy**, last: it shards whatever TP left (a TP-sharded weight becomes a
   2-D DTensor: Shard over dp, Shard over tp) and casts to the compute dtype on all-gather.

Pipeline splitting comes before all of them (``parallelize``): the pipeline package only splits the model and
schedules the stages. Context parallelism changes no weight: it cuts the batch and swaps the attention function
(context_parallel/hf.py); its ranks hold equal weights, so FSDP shards over them too (``mesh.fsdp_mesh``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .activation_checkpoint import apply_activation_checkpointing
from .fsdp import apply_fsdp
from .mesh import ParallelMesh
from .tensor_parallel import apply_tp

logger = logging.getLogger(__name__)


def check_not_parallelized(model: nn.Module) -> None:
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} already holds DTensor parameters (it was prepared before, or loaded with "
            "transformers' own tp_plan/distributed_config); pass an unsharded model to prepare()"
        )


def parallelize_part(part: nn.Module, mesh: ParallelMesh | None, *, activation_checkpointing: str | None = None,
                     mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """TP -> activation checkpointing -> FSDP/HSDP (+ precision policy), in place, on one model part.

    ``mesh`` may be None for a single process that only checkpoints activations.
    """
    config = mesh.config if mesh is not None else None
    # 1. tensor parallel: split Linear weights along the model's own plan.
    if config is not None and config.tp_size > 1:
        apply_tp(part, mesh["tp"], plan_overrides=config.tp_plan)
    # 2. activation checkpointing, per decoder layer this part owns.
    every = getattr(config, "activation_checkpointing_every", 1) if config is not None else 1
    apply_activation_checkpointing(part, activation_checkpointing, every)
    # 3. data parallel last: shard (or replicate) whatever TP produced, casting for compute on the way. Where no
    # dimension shards, a mixed-precision policy still needs fully_shard (over one rank) to do its casts, so
    # that TP-only, PP-only and one-process runs follow the same bf16 recipe as the sharded ones.
    if mesh is not None:
        dp_mesh = mesh.fsdp_mesh if mesh.fsdp_mesh is not None else (mesh["dp_shard"] if mp_policy else None)
        if dp_mesh is not None:
            apply_fsdp(part, dp_mesh, mp_policy=mp_policy)
    return part


def parallelize(model: nn.Module, mesh: ParallelMesh | None, device: torch.device, *,
                activation_checkpointing: str | None = None,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Apply the layout of ``mesh.config`` to ``model``; returns the model, or the pipeline wrapper under PP."""
    check_not_parallelized(model)
    config = mesh.config if mesh is not None else None
    options = dict(activation_checkpointing=activation_checkpointing, mp_policy=mp_policy)
    if config is not None and config.pp_size > 1:
        if config.pp_backend == "deepspeed":
            from .pipeline.deepspeed_backend import build_deepspeed_pipeline  # its engine shards and schedules

            apply_activation_checkpointing(model, activation_checkpointing, config.activation_checkpointing_every)
            return build_deepspeed_pipeline(model, mesh, config, device)
        from .pipeline import split_pipeline

        split = split_pipeline(model, mesh, config, device)
        for stage in split.stages:  # 0. pipeline split first, then every stage gets the same treatment
            parallelize_part(stage, mesh, **options)
        return split.assemble()
    return parallelize_part(model, mesh, **options)
