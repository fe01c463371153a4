"""Pipeline parallelism on torch.distributed.pipelining for an unmodified HF causal LM.

``PipelineModel`` is what ``prepare`` returns under pp_size > 1: calling it with a batch runs the whole
micro-batched schedule, forward and backward, and returns the global-token-mean loss (same value on every
rank). Its parameters are this rank's stage parameters, under their HF names.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from transformers.modeling_outputs import CausalLMOutputWithPast

from .schedules import SCHEDULES
from .split import StageSpec
from ..context_parallel.sharding import isolates_documents
from .step_inputs import check_step_inputs, global_label_tokens

logger = logging.getLogger(__name__)


class PipelineLoss:
    """Per micro-batch: HF's own causal-LM loss, summed over tokens and divided by the *global* token count."""

    def __init__(self, model: nn.Module):
        self.loss_function = model.loss_function
        self.vocab_size = model.config.get_text_config().vocab_size
        self.total_tokens: torch.Tensor | None = None
        self.shifted = False  # context parallelism hands over labels already shifted (and cut)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        extra = {"shift_labels": labels} if self.shifted else {}
        return self.loss_function(logits, labels, self.vocab_size, num_items_in_batch=self.total_tokens, **extra)


class PipelineModel(nn.Module):
    """This rank's pipeline stages behind the ``model(**batch)`` interface of a HF causal LM."""

    def __init__(self, stages: list[nn.Module], specs: list[StageSpec], num_stages: int, mesh, schedule: str,
                 microbatches: int, device: torch.device, loss: PipelineLoss, config, tied=None):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.specs = specs
        self.num_stages = num_stages
        self.mesh = mesh
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.device = device
        self.loss = loss
        self.config = config
        self.tied = tied  # TiedWeights or None
        self.cp = None  # CPRuntime when the sequence is also split (context parallelism)
        self.pad_id = 0
        self._schedules: dict[tuple, object] = {}
        self.has_first = any(s.index == 0 for s in specs)
        self.has_last = any(s.index == num_stages - 1 for s in specs)
        self.last_stage_pp_rank = self._pp_rank_of_last_stage()

    def _pp_rank_of_last_stage(self) -> int:
        info = SCHEDULES[self.schedule_name]
        p = self.mesh.size("pp")
        return 0 if info.placement == "v" else p - 1

    # HF names for everything that lists parameters (optimizer, clipping, state dicts).
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for stage in self.stages:
            yield from stage.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _schedule_for(self, shape: tuple):
        """Stages exchange buffers sized for one micro-batch shape: build (and cache) a schedule per shape."""
        if shape not in self._schedules:
            info = SCHEDULES[self.schedule_name]
            group = self.mesh["pp"].get_group()
            pipe_stages = [PipelineStage(m, s.index, self.num_stages, self.device, group=group)
                           for m, s in zip(self.stages, self.specs)]
            kwargs = dict(n_microbatches=self.microbatches, loss_fn=self.loss, scale_grads=False)
            self._schedules[shape] = info.cls(pipe_stages if info.multi_stage else pipe_stages[0], **kwargs)
        return self._schedules[shape]

    def forward(self, input_ids=None, labels=None, attention_mask=None, position_ids=None, num_items_in_batch=None,
                use_cache=None, **unused):
        check_step_inputs(input_ids, labels, unused, self.microbatches)
        side = {k: v for k, v in (("attention_mask", attention_mask), ("position_ids", position_ids)) if v is not None}
        # Stages run without a KV cache; transformers separates packed documents only then, so tell the stages
        # what the single-process forward would do with this call's use_cache.
        isolate = isolates_documents(self.config, use_cache)
        if self.cp is not None:  # cut the whole batch once; micro-batches split its rows, never its sequence
            from ..context_parallel.hf import shard_inputs

            side = shard_inputs(dict(input_ids=input_ids, labels=labels, **side), self.cp, self.pad_id, isolate).kwargs
            input_ids, labels = side.pop("input_ids"), side.pop("labels")
            side.pop("shift_labels")
        elif not isolate and position_ids is not None and attention_mask is None:
            side["attention_mask"] = torch.ones_like(input_ids)  # a mask turns transformers' packing detection off
        self.loss.shifted = self.cp is not None
        self.loss.total_tokens = global_label_tokens(labels, self.mesh, num_items_in_batch, shifted=self.loss.shifted)
        schedule = self._schedule_for(tuple(input_ids.shape))
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        target = labels if self.has_last else None
        if self.tied is not None:
            self.tied.snapshot()
        with self._cp_active():
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **side)
        if self.tied is not None:
            self.tied.sync_grads()
        return CausalLMOutputWithPast(loss=self._global_loss(losses))

    def _cp_active(self):
        import contextlib

        if self.cp is None:
            return contextlib.nullcontext()
        from ..context_parallel.hf import active

        return active(self.cp)

    def _global_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the micro-batch shares over dp/cp ranks, then sent from the last stage to every pp rank."""
        value = torch.stack([l.detach() for l in losses]).sum() if losses else torch.zeros((), device=self.device)
        value = value.to(self.device, torch.float32)
        dist.all_reduce(value, group=self.mesh["dp_cp"].get_group())
        pp_group = self.mesh["pp"].get_group()
        dist.broadcast(value, group=pp_group, group_src=self.last_stage_pp_rank)
        value._nd_parallel_backward_done = True  # accelerator.backward(loss) becomes a no-op
        return value
