"""Pipeline parallelism on DeepSpeed's pipeline engine for an unmodified HF causal LM.

The model is converted into a ``deepspeed.pipe.PipelineModule`` automatically (``layers``): one pipeline
layer for the embeddings, one per decoder layer, one for the head (final norm + lm_head). Every layer wraps
the model's own modules (no copies), and what a decoder layer needs besides the hidden states (attention
masks, rotary embeddings, positions) is computed by the model's own forward, run once per stage and
micro-batch on a skeleton whose decoder layers only record their arguments. Stage boundaries come from
``split.split_stages``, so both backends cut a model the same way. A tied embedding / lm_head pair
uses DeepSpeed's ``TiedLayerSpec``: its ReduceTiedGrads instruction sums the two copies' gradients.

The user's optimizer does the update, from the unchanged Accelerate loop: DeepSpeed gets an optimizer
that never steps, and its schedule's OptimizerStep instruction is replaced (``engine``). ``model`` holds
what the loop calls. This package's top level holds only the entry points the rest of nd_parallel calls.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from nd_parallel.models.hf import model_parts, shares_embedding

from ..balance import layer_counts
from ..split import split_stages
from ..stage import build_skeleton
from .engine import (
    check_device,
    check_same_parameters,
    init_distributed,
    make_engine,
    make_topology,
    presplit_module_class,
)
from .layers import LayerInputs, Source, check_model, layer_boundaries, layer_specs, plan_layers
from .model import DeepSpeedPipelineModel, MicroBatchLoss, TiedViaDeepSpeed

__all__ = ["build_deepspeed_pipeline", "check_model", "require_deepspeed"]

logger = logging.getLogger(__name__)


def require_deepspeed():
    """Import deepspeed, or say how to get it (checked before any collective)."""
    try:
        import deepspeed
        from deepspeed.pipe import PipelineModule  # noqa: F401  (fails on a broken install too)
    except ImportError as err:
        raise ImportError(
            f"pp_backend='deepspeed' needs the deepspeed package, which cannot be imported ({err}); install it "
            "with `pip install 'nd_parallel[deepspeed]'` (or `pip install deepspeed`), or use pp_backend='torch'"
        ) from err
    return deepspeed


def _check_layout(mesh) -> None:
    inner = {d: mesh.size(d) for d in ("dp_shard", "cp", "tp") if mesh.size(d) > 1}
    if inner:
        raise NotImplementedError(f"pp_backend='deepspeed' supports pipeline x dp_replicate only, got {inner}; "
                                  "use pp_backend='torch' for sharding, tensor or context parallelism")


def build_deepspeed_pipeline(model: nn.Module, mesh, config, device: torch.device) -> DeepSpeedPipelineModel:
    """Convert ``model`` into this rank's stage of a DeepSpeed PipelineModule and wrap it for the loop."""
    deepspeed = require_deepspeed()
    _check_layout(mesh)
    check_device(device)
    check_model(model)
    parts = model_parts(model)
    pp, dp, microbatches = config.pp_size, mesh.size("dp_replicate"), config.microbatches
    specs = split_stages(parts, pp, layer_counts(config, parts.num_layers, model, mesh))
    counts = [len(s.layers) for s in specs]
    pp_rank = mesh.local_rank("pp")
    init_distributed(deepspeed, device)
    topology = make_topology(mesh, pp, dp)
    source = Source(model)
    inputs = LayerInputs(model, parts, with_embeddings=pp_rank == 0)
    loss = MicroBatchLoss(model, microbatches)
    tied = shares_embedding(model)
    with torch.no_grad():  # DeepSpeed broadcasts the tied weight between its stages in place
        pipe = presplit_module_class()(
            layer_specs(plan_layers(source, parts, counts, inputs)), layer_boundaries(counts, parts.num_layers),
            topology=topology, loss_fn=loss, activation_checkpoint_interval=0)
    skeleton = build_skeleton(model, parts, specs[pp_rank], pp)  # HF names for the same module objects
    source.model = None
    check_same_parameters(pipe, skeleton)
    engine = make_engine(deepspeed, pipe, microbatches, dp)
    duplicate = skeleton.get_output_embeddings().weight if tied and pp_rank == pp - 1 else None
    logger.info("applied PP over %d ranks with DeepSpeed's pipeline engine (x dp %d): layers per stage %s, "
                "%d micro-batches%s", pp, dp, counts, microbatches, ", tied embeddings" if tied else "")
    return DeepSpeedPipelineModel(engine, skeleton, specs[pp_rank], mesh, inputs, loss, microbatches, device,
                                  model.config, TiedViaDeepSpeed(duplicate) if tied else None)
