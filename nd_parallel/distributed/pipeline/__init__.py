"""Pipeline parallelism: split (pure), stage building, schedules, the torch backend.

This package splits and schedules; the order in which TP, activation checkpointing and FSDP are applied to each
stage is decided in one place, ``nd_parallel/distributed/parallelize.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from nd_parallel.models.hf import UnsplittableModel, embedding_and_head, model_parts, shares_embedding

from ..chunked_loss import ChunkedHead
from ..loss import own_loss_unshifted
from .balance import layer_counts
from .schedules import SCHEDULES, check_microbatches
from .split import split_stages, stage_ids_for_rank
from .stage import check_layer_inputs, check_stand_ins, make_stage_module
from .torch_backend import PipelineLoss, PipelineModel

logger = logging.getLogger(__name__)


class TiedWeights:
    """Keeps a tied embedding / lm_head pair equal when the two live in different stages.

    The stages hold separate copies; after every schedule step each copy's gradient receives what the other
    copy's step added (together: what a single shared parameter would receive), so identical AdamW updates
    keep them identical.
    """

    def __init__(self, embed: nn.Parameter | None, head: nn.Parameter | None, group):
        self.embed, self.head, self.group = embed, head, group

    @property
    def duplicate(self) -> nn.Parameter | None:
        """The copy left out of the gradient norm, so the shared weight is counted once."""
        return self.head

    @staticmethod
    def _local(grad):
        return grad.to_local() if hasattr(grad, "to_local") else grad

    @staticmethod
    def _match_placement(param: nn.Parameter) -> None:
        # A vocab-sharded embedding's gradient can come back replicated; give both copies the parameter's
        # own layout so their local pieces line up element for element.
        grad = param.grad
        if hasattr(grad, "placements") and tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)

    def snapshot(self) -> None:
        """Remember the (already equal) gradients before a step, so only what the step adds is exchanged:
        with gradient accumulation, summing the whole accumulated gradient again would count earlier
        micro-batches twice."""
        held = [p for p in (self.embed, self.head) if p is not None and p.requires_grad]  # frozen (LoRA): no grad
        for p in held:
            if p.grad is not None:
                self._match_placement(p)
        self._before = {id(p): (self._local(p.grad).clone() if p.grad is not None else None) for p in held}

    def sync_grads(self) -> None:
        held = [p for p in (self.embed, self.head) if p is not None and p.requires_grad]  # frozen (LoRA): no grad
        for p in held:
            self._match_placement(p)
        added = []
        for p in held:
            before = getattr(self, "_before", {}).get(id(p))
            grad = self._local(p.grad)
            added.append(grad - before if before is not None else grad.clone())
        if len(held) == 2:  # both copies on this rank (V-shaped schedules): add locally
            total = added[0] + added[1]
        elif held and self.group is not None:
            total = added[0].clone()  # all_reduce works in place; `added` must keep this copy's own increment
            dist.all_reduce(total, group=self.group)
        else:
            return
        for p, own in zip(held, added):
            self._local(p.grad).add_(total - own)  # before + own + other's increment


def _tied_group(mesh, first_pp: int, last_pp: int):
    """One process group per (dp, cp, tp) coordinate joining the ranks of the first and the last stage."""
    ranks = mesh.world.mesh  # [pp, dp_replicate, dp_shard, cp, tp] -> global rank
    mine = None
    for a, b in zip(ranks[first_pp].flatten().tolist(), ranks[last_pp].flatten().tolist()):
        group = dist.new_group([a, b])  # every rank creates every group, in the same order
        if dist.get_rank() in (a, b):
            mine = group
    return mine


def _untie(model: nn.Module) -> bool:
    """Give lm_head its own copy of a tied weight (the stages holding them are different modules)."""
    if not shares_embedding(model):
        return False
    emb, head = embedding_and_head(model)
    head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
    return True


def validate_pipeline(model: nn.Module, config) -> None:
    """Every pipeline check that needs only the model and the config (run before any collective)."""
    parts = model_parts(model)
    num_stages = config.pp_size * config.pp_virtual_stages
    counts = None if config.pp_balance == "profile" else layer_counts(config, parts.num_layers)
    split_stages(parts, num_stages, counts)
    check_microbatches(config.pp_schedule, config.pp_size, config.microbatches)
    if config.pp_backend == "deepspeed":
        from .deepspeed_backend import check_model  # optional dependency: imported on use

        check_model(model)
    else:
        check_stand_ins(model, parts)
    check_layer_inputs(model, parts)
    if own_loss_unshifted(model):
        raise UnsplittableModel(
            f"{type(model).__name__}'s forward computes its own cross-entropy on unshifted labels, while the last "
            "pipeline stage computes transformers' causal-LM loss (labels shifted by one), so the two would "
            "differ; use pp_size=1 for this model (FSDP/DDP keep its own loss)")


@dataclass
class PipelineSplit:
    """This rank's stage modules, not yet parallelized; ``assemble`` wraps them once parallelize.py is done."""

    model: nn.Module
    mesh: object
    config: object
    device: torch.device
    stages: list[nn.Module]
    specs: list
    num_stages: int
    loss: PipelineLoss
    tied: bool

    def assemble(self) -> PipelineModel:
        """Bind tied weights to the (now sharded) stage parameters and wrap the stages for the training loop."""
        config, mesh, mine, stages = self.config, self.mesh, self.specs, self.stages
        info = SCHEDULES[config.pp_schedule]
        tied_weights = None
        if self.tied:
            last_pp = 0 if info.placement == "v" else config.pp_size - 1
            group = _tied_group(mesh, 0, last_pp) if last_pp != 0 else None
            index = [s.index for s in mine]
            embed = stages[index.index(0)].get_input_embeddings().weight if 0 in index else None
            last = self.num_stages - 1
            head = stages[index.index(last)].get_output_embeddings().weight if last in index else None
            tied_weights = TiedWeights(embed, head, group)
        pipe = PipelineModel(stages, mine, self.num_stages, mesh, config.pp_schedule, config.microbatches,
                             self.device, self.loss, self.model.config, tied_weights)
        return pipe


def split_pipeline(model: nn.Module, mesh, config, device: torch.device) -> PipelineSplit:
    """Split ``model`` into this rank's stage modules (skeleton copies, HF names kept); no parallelism applied.

    parallelize.py applies TP, activation checkpointing and FSDP to each stage, then calls ``assemble``.
    """
    parts = model_parts(model)
    num_stages = config.pp_size * config.pp_virtual_stages
    specs = split_stages(parts, num_stages, layer_counts(config, parts.num_layers, model, mesh))
    info = SCHEDULES[config.pp_schedule]
    check_microbatches(config.pp_schedule, config.pp_size, config.microbatches)
    pp_rank = mesh.local_rank("pp")
    mine = [specs[i] for i in stage_ids_for_rank(pp_rank, config.pp_size, config.pp_virtual_stages, info.placement)]
    loss = PipelineLoss(model)
    tied = _untie(model)
    stages = [make_stage_module(model, parts, spec, num_stages) for spec in mine]
    last = [stage for stage, spec in zip(stages, mine) if spec.index == num_stages - 1]
    if last and config.loss_chunk_tokens:
        runner = last[0]._nd_stage_runner
        loss.head, runner.loss = ChunkedHead(last[0], runner.causal_lm_forward, config.loss_chunk_size), loss
    counts = [len(s.layers) for s in specs]
    logger.info("applied PP over %d ranks: %d stages (layers per stage %s), schedule %s, %d micro-batches",
                config.pp_size, num_stages, counts, config.pp_schedule, config.microbatches)
    return PipelineSplit(model, mesh, config, device, stages, mine, num_stages, loss, tied)
