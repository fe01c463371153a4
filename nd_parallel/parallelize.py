"""The one place that decides the order in which parallelisms are applied to a model.

Order matters: TP must see plain ``nn.Linear`` weights to split them, and FSDP must come last so it shards
whatever TP left (a TP-sharded weight becomes a 2-D DTensor: Shard over dp, Shard over tp). Pipeline
splitting (first) and context parallelism (between TP and FSDP) slot into this sequence.
"""

from __future__ import annotations

import logging

import torch.nn as nn
from torch.distributed.tensor import DTensor

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


def parallelize(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Apply TP then FSDP/HSDP to ``model`` in place, following ``mesh.config``."""
    config = mesh.config
    check_not_parallelized(model)
    if config.pp_size > 1:
        raise NotImplementedError("pp_size > 1: pipeline parallelism is not available in this version yet")
    # 1. tensor parallel: split Linear weights along the model's own plan.
    if config.tp_size > 1:
        apply_tp(model, mesh["tp"], plan_overrides=config.tp_plan)
    # Context parallelism changes no weight: it cuts the batch and swaps the attention function
    # (context_parallel/hf.py); its ranks hold equal weights, so FSDP shards over them too (mesh.fsdp_mesh).
    # 2. data parallel last: shard (or replicate) whatever TP produced.
    if mesh.fsdp_mesh is not None:
        apply_fsdp(model, mesh.fsdp_mesh)
    return model
