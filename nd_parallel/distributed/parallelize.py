"""The one place that decides how a model is laid out, and in what order.

``parallelize`` takes a model as the user built it (a Hugging Face causal LM, a ``PeftModel`` around one, with
real weights or built on the meta device by ``models.loading``) and returns what training runs: the same model
sharded in place, or under pipeline parallelism the wrapper of this rank's stages. Its steps, in order:

1. **Checks** that need no process group (``check_model``), so bad input never reaches a collective.
2. **The load path.** A meta-built model is read later, slice by slice, into the shards each rank owns (step 10);
   where every rank needs the whole model first (one process, DeepSpeed's engine, profiled balancing) it is read
   now. A model with real weights moves to the device. One sharded by transformers' own ``tp_plan`` at load is
   first gathered back into plain tensors (``transformers_tp.py``), so every layout applies its own plan to it.
3. **Adapters**: every rank starts from rank 0's adapter init (ranks seeded differently would otherwise diverge).
4. **The mesh**, built on first use (a collective).
5. **Context parallelism** swaps the attention function before any split, since pipeline stages share the model's
   config. CP changes no weight: its ranks hold equal weights, so FSDP shards over them too (``mesh.fsdp_mesh``).
6. **Pipeline split** (torch backend): this rank's stage modules, HF names kept. DeepSpeed's engine instead splits,
   shards and schedules by itself after activation checkpointing is applied to the whole model.
7. **Per model part** (the whole model, or each stage), ``parallelize_part``: TP -> EP -> compile (``compile=True``)
   -> activation checkpointing -> memory options (tiled MLP, activation offloading: memory.py) -> FSDP/HSDP with the
   precision and offload policies (a quantized base left out of sharding).

   - TP first: it must see plain ``nn.Linear`` weights to split them.
   - EP next (``expert_parallel``): the experts' stacked weights become ep-sharded DTensors and their calls go
     through the all-to-all dispatch; FSDP then gives the experts a group of their own over the dp ranks left
     after ep (``mesh.expert_fsdp_mesh``), so it must come after EP and see the experts' DTensors.
   - Checkpointing next: the recomputed region then holds TP's functional collectives, and FSDP's all-gather
     hooks, added after, stay outside the region and are not repeated by the recomputation.
   - FSDP last: it shards whatever TP left (a TP-sharded weight becomes a 2-D DTensor) and casts for compute.
8. **Pipeline assembly**: tied weights bound across stages, the schedule wrapper, the CP runtime and the timeline.
9. **Hooks** on a non-pipelined model: the global-token-mean loss over the dp x cp ranks, CP's sequence
   sharding of the batch, and the chunked loss (``chunked_loss.py``: the full logits never held), installed after
   the global-token hooks because it is called inside them with the global token count.
10. **The meta path reads**: each rank fills only the pieces it owns from the safetensors files.
11. **The parameter map**: which parameter now stands for each original one on this rank, so an optimizer
    built on the unsharded model can be re-pointed (as Accelerate does for FSDP2).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from nd_parallel.config import ParallelismConfig
from nd_parallel.models import peft
from nd_parallel.models.loading import LoadReport, lazy_checkpoint, load_local_shards, reads_whole_model
from nd_parallel.models.qat import check_qat_layout
from nd_parallel.models.quantized import accept_4bit_state, check_quantized, expose_8bit_scales

from . import (
    activation_checkpoint,
    context_parallel,
    expert_parallel,
    memory,
    router_loss,
    tensor_parallel,
    transformers_tp,
)
from .activation_checkpoint import apply_activation_checkpointing
from .chunked_loss import ChunkedLoss
from .classification import check_classification_layout
from .compile import apply_compile, check_backend
from .fsdp import apply_fsdp
from .loss import GlobalTokenLoss
from .mesh import ParallelMesh
from .tensor_parallel import apply_tp

logger = logging.getLogger(__name__)


@dataclass
class Parallelized:
    """What ``parallelize`` hands back."""

    model: nn.Module
    """The model to train: the input model (or its PeftModel) sharded in place, or the pipeline of this rank."""
    replaced: dict[int, list[nn.Parameter]] = field(default_factory=dict)
    """id of an original parameter -> the parameter(s) standing for it on this rank: none where another stage
    owns it, two for a tied weight whose copies both live here."""
    loading: LoadReport | None = None
    """What this rank read from the checkpoint, for a model from ``models.loading.from_pretrained``."""


def check_not_parallelized(model: nn.Module) -> None:
    if transformers_tp.is_sharded_by_transformers(peft.base_of(model)):  # adopted: gathered back in step 2
        transformers_tp.check_transformers_tp(peft.base_of(model), has_adapter=peft.base_of(model) is not model)
        return
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} already holds DTensor parameters (it was prepared before, or loaded with "
            "transformers' own tp_plan/distributed_config); pass an unsharded model to prepare()"
        )


def check_model(model: nn.Module, config: ParallelismConfig, device_type: str) -> None:
    """Step 1: everything the layout needs from the model, checked without any process group."""
    from .pipeline import validate_pipeline

    check_not_parallelized(model)
    peft.check_peft_model(model)
    check_quantized(peft.base_of(model), config, has_adapter=peft.base_of(model) is not model)
    model = peft.base_of(model)  # a PeftModel is split as the HF model inside it
    activation_checkpoint.check_model(model, config.activation_checkpointing)
    check_classification_layout(model, config)  # reward / process reward models: no pp, no cp
    if config.compile:
        check_backend(config.compile_backend, device_type)
    if config.pp_size > 1:
        validate_pipeline(model, config)
    if config.cp_size > 1:
        context_parallel.check_model(model, config, device_type)
    if config.tp_size > 1:
        tensor_parallel.check_model(model, config)
    expert_parallel.check_model(model, config)
    router_loss.check_model(model, config)
    check_qat_layout(model, config)
    if config.tiled_mlp:
        memory.check_tiled_mlp(model)


def parallelize_part(part: nn.Module, mesh: ParallelMesh | None, *, activation_checkpointing: str | None = None,
                     mp_policy: MixedPrecisionPolicy | None = None, config: ParallelismConfig | None = None) -> nn.Module:
    """Step 7 on one model part, in place: TP -> EP -> compile -> activation checkpointing -> memory options ->
    FSDP/HSDP (+ precision and offload policies). compile.py says why compiling sits there in the order.

    ``mesh`` may be None for a single process that only checkpoints activations (``config`` then gives the memory
    options; by default the mesh's). The memory options (memory.py) wrap the checkpointed layer and the MLP before
    FSDP, whose hooks, like its all-gathers, then stay outside the tiles and the offloaded region.
    """
    config = config if config is not None else (mesh.config if mesh is not None else None)
    if config is not None and config.tp_size > 1:
        apply_tp(part, mesh["tp"], plan_overrides=tensor_parallel.plan_overrides(part, config),
                 sequence_parallel=config.sequence_parallel)
    experts = expert_parallel.apply_ep(part, mesh["ep"]) if config is not None and config.ep_size > 1 else []
    if config is not None and config.compile:
        apply_compile(part, config.compile_backend)
    every = config.activation_checkpointing_every if config is not None else 1
    apply_activation_checkpointing(part, activation_checkpointing, every)
    memory.apply_memory_options(part, config)
    # Where no dimension shards, a mixed-precision or offload policy still needs fully_shard (over one rank) to act,
    # so that TP-only, PP-only and one-process runs follow the same recipe as the sharded ones.
    offload = config is not None and config.fsdp_offload_params
    if mesh is not None:
        dp_mesh = mesh.fsdp_mesh if mesh.fsdp_mesh is not None else (mesh["dp_shard"] if mp_policy or offload else None)
        if dp_mesh is not None:
            apply_fsdp(part, dp_mesh, mp_policy=mp_policy, experts=experts, expert_mesh=mesh.expert_fsdp_mesh,
                       offload_params=offload)
    return part


def parallelize(model: nn.Module, config: ParallelismConfig, device: torch.device,
                mesh: Callable[[], ParallelMesh | None], *, distributed: bool,
                mp_policy: MixedPrecisionPolicy | None = None) -> Parallelized:
    """Lay ``model`` out as ``config`` says, in the order of the module docstring.

    ``mesh()`` builds the mesh on first use (a collective, after the checks and the whole-model reads) and
    returns None where nothing needs one (one process in fp32). ``distributed``: more than one process.
    """
    check_model(model, config, device.type)  # 1
    wrapper, model = peft.unwrap(model)
    inner = model
    result = Parallelized(model)
    lazy = lazy_checkpoint(model)  # 2
    if lazy is not None and (not distributed or reads_whole_model(config)):
        result.loading, lazy = load_local_shards([model], lazy, device), None
    ac_mode = activation_checkpoint.requested_mode(model, config.activation_checkpointing)
    # sharded by transformers' tp_plan at load: gathered back, so the layout applies its own plan (a collective)
    adopted = transformers_tp.gather_transformers_tp(model) if transformers_tp.is_sharded_by_transformers(model) else {}
    before = dict(model.named_parameters(remove_duplicate=False))
    if lazy is None:
        model.to(device)
    expose_8bit_scales(model)  # an 8-bit base's scales named for torch's distributed state dict (models/quantized.py)
    accept_4bit_state(model)  # a 4-bit base loads back the quantization state it saves (load_state, strict)
    if wrapper is not None:  # 3
        peft.broadcast_trainable(lazy.initial_tensors() if lazy is not None else
                                 [p for p in model.parameters() if p.requires_grad], device)
    moved = dict(model.named_parameters(remove_duplicate=False))
    the_mesh = mesh()  # 4
    if config.cp_size > 1:  # 5
        context_parallel.use_cp_attention(model)
    model = _split_and_shard(model, the_mesh, config, device, ac_mode, mp_policy)  # 6, 7, 8
    if distributed and config.pp_size == 1:  # 9
        model._nd_parallel_loss = GlobalTokenLoss(model, the_mesh["dp_cp"].get_group(), the_mesh["dp"].get_group())
        if config.cp_size > 1:
            model._nd_parallel_cp = context_parallel.SequenceSharding(model, context_parallel.runtime_for(the_mesh,
                                                                                                        config))
    if config.pp_size == 1 and config.loss_chunk_tokens:
        model._nd_parallel_chunked_loss = ChunkedLoss(model, config.loss_chunk_size)
    if lazy is not None:  # 10
        result.loading = load_local_shards(list(getattr(model, "stages", [model])), lazy, device)
    result.replaced = _parameter_map(before, moved, dict(model.named_parameters(remove_duplicate=False)))  # 11
    result.replaced.update({old: result.replaced[id(new)] for old, new in adopted.items()})
    result.model = peft.rewrap(wrapper, model, inner)
    return result


def _split_and_shard(model: nn.Module, mesh: ParallelMesh | None, config: ParallelismConfig, device: torch.device,
                     ac_mode: str | None, mp_policy: MixedPrecisionPolicy | None) -> nn.Module:
    """Steps 6-8: the pipeline split, then every part the same treatment, then the pipeline assembly."""
    options = dict(activation_checkpointing=ac_mode, mp_policy=mp_policy, config=config)
    if config.pp_size == 1:
        return parallelize_part(model, mesh, **options)
    if config.pp_backend == "deepspeed":
        from .pipeline.deepspeed_backend import build_deepspeed_pipeline

        apply_activation_checkpointing(model, ac_mode, config.activation_checkpointing_every)
        memory.apply_memory_options(model, config)
        return build_deepspeed_pipeline(model, mesh, config, device)
    from .pipeline import split_pipeline

    split = split_pipeline(model, mesh, config, device)
    for stage in split.stages:
        parallelize_part(stage, mesh, **options)
    pipe = split.assemble()
    if config.cp_size > 1:
        pipe.cp, pipe.pad_id = context_parallel.runtime_for(mesh, config), context_parallel.pad_token_id(model)
    if config.pp_timeline:
        from .pipeline.timeline.record import TimelineRecorder, attach

        attach(pipe, TimelineRecorder(mesh["pp"].get_group()), out_dir=config.pp_timeline,
               write_at_step=config.pp_timeline_step)
    return pipe


def _parameter_map(before: dict, moved: dict, after: dict) -> dict[int, list[nn.Parameter]]:
    """Old parameter (as built, and after moving to the device) -> the parameter(s) now standing for it here."""
    replaced: dict[int, list[nn.Parameter]] = {}
    for name, old in before.items():
        for key in (id(old), id(moved[name])):
            # Absent from `after`: another stage owns it. The empty entry drops it from the optimizer, which would
            # otherwise keep this rank's copy of the whole unsharded model alive.
            targets = replaced.setdefault(key, [])
            if name in after and all(t is not after[name] for t in targets):
                targets.append(after[name])
    return replaced
