"""``trl.async_prefetch: true`` (rl: grpo / gdpo / ebft) with Axolotl 0.19's meaning, made deterministic.

Axolotl's async trainer generates the next rollouts in a background thread (on a vLLM server) while the trainer
steps on the current ones: the rollouts a step trains on were sampled by the policy of an earlier step, and the loss
corrects for it with the sampling policy's log-probs (PPO's clipped ratio; ``vllm_importance_sampling_*`` adds
vLLM's own mismatch). How far behind the sampler is depends on the thread's timing there; here it is exactly
``prefetch_depth`` optimizer steps (default 1): the rollouts of step k are sampled, and their ``old`` log-probs
computed, with the trainable weights as they were at the start of step k - prefetch_depth (the first steps: the
initial weights). No thread: the same arithmetic in order, so one process and every layout sample the same tokens
(keyed sampling, grpo_rank.py). The sampler and the trainer are the same model here, so vLLM's importance-sampling
correction is 1 and not applied.

Written by hand: TRL's GRPOTrainer generates with the current weights. ``StaleWeights`` keeps the trainable
parameters' local pieces (a LoRA adapter; under full fine-tuning the rank's shards) of the last prefetch_depth + 1
step starts and swaps the oldest in around generation and scoring.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from transformers import TrainerCallback


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p.data


def _reshard(model) -> None:
    """FSDP2 modules drop any unsharded parameters, so the next forward gathers the shards as they are now."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class StaleWeights(TrainerCallback):
    """Snapshots of the trainable parameters at each step start (``on_step_begin``); ``swapped()`` runs a block with
    the oldest kept snapshot in place."""

    def __init__(self, trainer, depth: int):
        self.trainer, self.params = trainer, None
        self.kept = collections.deque(maxlen=depth + 1)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.params is None:  # the prepared model's (FSDP2 replaced them by DTensors)
            self.params = [p for p in self.trainer.model.parameters() if p.requires_grad]
        self.kept.append([_local(p).detach().clone() for p in self.params])
        return control

    @contextlib.contextmanager
    def swapped(self):
        if not self.kept:  # evaluation before the first step: the current weights
            yield
            return
        now = [_local(p).detach().clone() for p in self.params]
        _reshard(self.trainer.model)
        with torch.no_grad():
            for p, old in zip(self.params, self.kept[0]):
                _local(p).copy_(old)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, current in zip(self.params, now):
                    _local(p).copy_(current)
            _reshard(self.trainer.model)


def old_log_probs(trainer, output: dict) -> torch.Tensor:
    """The sampling policy's per-token log-probs of a generation batch (TRL computes them only for batches it knows
    to be off-policy), with the same call TRL makes."""
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    batch = trainer.args.per_device_train_batch_size
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                                 output["completion_ids"].size(1), batch_size=batch)
    return logps


def generate_and_score(trainer, generate, inputs) -> dict:
    """TRL's ``generate(inputs)`` (generation and scoring) with the stale weights in place in training, the old
    log-probs added where TRL left them out; as TRL does it elsewhere."""
    if trainer.stale is None or not trainer.model.training:
        return generate(inputs)
    with trainer.stale.swapped():
        output = generate(inputs)
        if "old_per_token_logps" not in output:
            output["old_per_token_logps"] = old_log_probs(trainer, output)
    return output
