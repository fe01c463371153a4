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

from nd_parallel.distributed.chunked_loss import shifted_targets
from nd_parallel.distributed.context_parallel.sharding import isolates_documents
from nd_parallel.models.hf import vocab_size

from .schedules import SCHEDULES
from .split import StageSpec
from .step_inputs import check_step_inputs, global_label_tokens

logger = logging.getLogger(__name__)
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # logits dtypes, by index on the wire


# torch's pipelining infers the shapes between stages by running each stage's forward, and the last stage's loss and
# backward, on torch.empty buffers: uninitialised memory, zeros or NaN or anything. It does so whenever a schedule
# first runs a kind of step (a training step after an evaluation on the same schedule: again). The method names are
# torch's private API: 2.13's and the earlier releases' (tests/unit/test_pp_split.py checks they exist).
METADATA_METHODS = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def mark_metadata_calls(stage: PipelineStage, loss: PipelineLoss) -> PipelineStage:
    """Sets ``loss.metadata_call`` while ``stage`` infers metadata (see above)."""
    for name in METADATA_METHODS:
        inner = getattr(stage, name, None)
        if inner is None:
            continue

        def marked(*args, _inner=inner, **kwargs):
            loss.metadata_call = True
            try:
                return _inner(*args, **kwargs)
            finally:
                loss.metadata_call = False

        setattr(stage, name, marked)
    return stage


class PipelineLoss:
    """Per micro-batch: HF's own causal-LM loss, summed over tokens and divided by the *global* token count.

    With a chunked head (``chunked_loss.ChunkedHead`` of the last stage, on the rank that holds it) and in a
    training step, the last stage hands over its final hidden states instead of logits and the loss is the chunked
    cross-entropy through the stage's head, so the full logits of a micro-batch are never held.
    """

    def __init__(self, model: nn.Module):
        self.loss_function = model.loss_function
        self.vocab_size = vocab_size(model)
        self.total_tokens: torch.Tensor | None = None
        self.shifted = False  # context parallelism hands over labels already shifted (and cut)
        self.head = None  # ChunkedHead of this rank's last stage, when the loss is chunked
        self.training = False  # set per call: evaluation keeps the full logits
        self.stats: list[torch.Tensor] | None = None  # token sums per call, when the caller asks (token_stats)
        self.metadata_call = False  # True while torch infers metadata on garbage (mark_metadata_calls)
        # fp16's loss scale: () -> 0-d tensor (grad_scaler.MeshGradScaler.loss_scale), set by the integration. The
        # schedule runs backward on what this returns, so the scale must multiply it here, not in
        # accelerator.backward; ``scale`` is the value taken for the current step, divided out of the loss returned.
        self.grad_scale = None
        self.scale: torch.Tensor | None = None

    def chunks(self) -> bool:
        """Whether the last stage hands over hidden states this call (its runner asks before each forward)."""
        return self.training and self.head is not None and self.head.enabled

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self._loss(output, labels)
        return loss if self.scale is None else loss * self.scale

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.chunks():
            targets = labels if self.shifted else shifted_targets(labels, None)
            return self.head.loss(output, targets, self.total_tokens)
        extra = {"shift_labels": labels} if self.shifted else {}
        if self.stats is not None and not self.metadata_call:  # garbage counts no token
            self.stats.append(token_stats(output, labels, self.shifted))
        return self.loss_function(output, labels, self.vocab_size, num_items_in_batch=self.total_tokens, **extra)


def token_stats(logits: torch.Tensor, labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    """[label tokens, tokens whose label is the top-1 prediction, entropy sum over label tokens] (float64), the
    sums behind a trainer's token accuracy and entropy. Without gradient."""
    with torch.no_grad():
        if not shifted:
            logits, labels = logits[:, :-1], labels[:, 1:]
        mask = labels != -100
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        correct = (logits.argmax(-1) == labels) & mask
        return torch.stack([mask.sum().double(), correct.sum().double(), (entropy * mask).sum().double()])


class PipelineModel(nn.Module):
    """This rank's pipeline stages behind the ``model(**batch)`` interface of a HF causal LM."""

    supports_eval = True  # model.eval() / no_grad runs the forward-only schedule

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
            pipe_stages = [mark_metadata_calls(PipelineStage(m, s.index, self.num_stages, self.device, group=group),
                                               self.loss) for m, s in zip(self.stages, self.specs)]
            kwargs = dict(n_microbatches=self.microbatches, loss_fn=self.loss, scale_grads=False)
            self._schedules[shape] = info.cls(pipe_stages if info.multi_stage else pipe_stages[0], **kwargs)
        return self._schedules[shape]

    def forward(self, input_ids=None, labels=None, attention_mask=None, position_ids=None, num_items_in_batch=None,
                use_cache=None, shift_labels=None, return_token_stats=False, **unused):
        """A training step (forward + backward of every micro-batch), or under ``model.eval()`` / ``no_grad`` a
        forward-only pass that touches no gradient and returns the loss (if labels) and the full logits.
        ``return_token_stats``: a training step also returns ``token_stats`` (``token_stats()`` of every label token
        of the global batch, summed over micro-batches and dp/cp ranks on the last stage, then sent to every pp
        rank), what a trainer's token accuracy / entropy needs: the training schedule returns no logits.

        ``shift_labels`` (targets already shifted: position t's label is token t+1, as Accelerate's CP collate
        writes them) take precedence over ``labels``, as in transformers' own loss."""
        evaluating = not (self.training and torch.is_grad_enabled())
        shifted = shift_labels is not None
        if shifted:
            labels = shift_labels
        check_step_inputs(input_ids, labels, unused, self.microbatches, labels_required=not evaluating)
        seq_len = input_ids.shape[1]
        has_labels = labels is not None
        if not has_labels:  # the last stage's loss function needs a target: one that counts no token
            labels = torch.full_like(input_ids, -100)
        side = {k: v for k, v in (("attention_mask", attention_mask), ("position_ids", position_ids)) if v is not None}
        # Stages run without a KV cache; transformers separates packed documents only then, so tell the stages
        # what the single-process forward would do with this call's use_cache.
        isolate = isolates_documents(self.config, use_cache)
        if self.cp is not None:  # cut the whole batch once; micro-batches split its rows, never its sequence
            from nd_parallel.distributed.context_parallel.hf import shard_inputs

            given = {"shift_labels" if shifted else "labels": labels}
            side = shard_inputs(dict(input_ids=input_ids, **given, **side), self.cp, self.pad_id, isolate).kwargs
            input_ids, labels = side.pop("input_ids"), side.pop("labels")
            side.pop("shift_labels")
        elif not isolate and position_ids is not None and attention_mask is None:
            side["attention_mask"] = torch.ones_like(input_ids)  # a mask turns transformers' packing detection off
        self.loss.shifted = self.cp is not None or shifted
        self.loss.training = not evaluating
        self.loss.scale = self.loss.grad_scale() if self.loss.grad_scale is not None and not evaluating else None
        self.loss.total_tokens = global_label_tokens(labels, self.mesh, num_items_in_batch, shifted=self.loss.shifted)
        schedule = self._schedule_for(tuple(input_ids.shape))
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        target = labels if self.has_last else None
        if evaluating:
            with self._cp_active(), torch.no_grad():
                logits = schedule.eval(*args, target=target, losses=losses, **side)
            return CausalLMOutputWithPast(loss=self._global_loss(losses) if has_labels else None,
                                          logits=self._share_logits(logits, input_ids.shape[0], seq_len))
        if self.tied is not None:
            self.tied.snapshot()
        self.loss.stats = [] if return_token_stats else None
        with self._cp_active():
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **side)
        if self.tied is not None:
            self.tied.sync_grads()
        loss = self._global_loss(losses)
        loss._nd_parallel_backward_done = True  # accelerator.backward(loss) becomes a no-op
        out = CausalLMOutputWithPast(loss=loss)
        if return_token_stats:
            out.token_stats, self.loss.stats = self._global_sum(self._step_stats(self.loss.stats)), None
        return out

    def _step_stats(self, calls: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's token sums over the step's micro-batches. torch's schedule also calls the loss once
        while it infers the backward metadata of a new batch shape (PipelineStage, first step per shape), before
        any micro-batch: only the last ``microbatches`` calls are the step's."""
        mine = calls[-self.microbatches:] if self.has_last else []
        return torch.stack(mine).sum(0) if mine else torch.zeros(3, dtype=torch.float64, device=self.device)

    def _share_logits(self, logits: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor:
        """The last stage's logits on every pp rank, over the whole sequence (cp shards gathered back)."""
        if self.cp is not None and logits is not None:
            from nd_parallel.distributed.context_parallel.hf import gather_sequence

            logits = gather_sequence(logits, self.cp, seq_len)
        group = self.mesh["pp"].get_group()
        # Only the last stage knows the vocabulary width and dtype the head produced: send those first.
        meta = torch.zeros(2, dtype=torch.int64, device=self.device)
        if logits is not None:
            meta[0], meta[1] = logits.shape[-1], _DTYPES.index(logits.dtype)
        dist.broadcast(meta, group=group, group_src=self.last_stage_pp_rank)
        if logits is None:
            logits = torch.empty(batch, seq_len, int(meta[0]), dtype=_DTYPES[int(meta[1])], device=self.device)
        else:
            logits = logits.contiguous()
        dist.broadcast(logits, group=group, group_src=self.last_stage_pp_rank)
        return logits

    def generate(self, *args, **kwargs):
        raise NotImplementedError(
            "generate() under pipeline parallelism: each decoding step would be a full pipeline pass with one "
            "token in flight, so it is not offered; save the model (accelerator.save_model) and generate with it "
            "unprepared, or prepare it with a layout without pp (DDP, FSDP, TP)")

    def _cp_active(self):
        import contextlib

        if self.cp is None:
            return contextlib.nullcontext()
        from nd_parallel.distributed.context_parallel.hf import active

        return active(self.cp)

    def _global_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the micro-batch shares over dp/cp ranks, then sent from the last stage to every pp rank."""
        value = torch.stack([l.detach() for l in losses]).sum() if losses else torch.zeros((), device=self.device)
        if self.loss.scale is not None:  # fp16: the schedule's losses carry the loss scale (a power of two: exact)
            value = value / self.loss.scale.to(value.device)
        return self._global_sum(value.to(self.device, torch.float32))

    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (this rank's; meaningful on the last stage) summed over dp/cp, the same on every pp rank."""
        dist.all_reduce(value, group=self.mesh["dp_cp"].get_group())
        pp_group = self.mesh["pp"].get_group()
        dist.broadcast(value, group=pp_group, group_src=self.last_stage_pp_rank)
        return value
