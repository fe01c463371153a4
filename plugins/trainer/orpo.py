"""TRL's ``ORPOTrainer`` (1.16, ``trl.experimental.orpo``) under FSDP2 / HSDP / DDP / TP / CP / EP: its loss that of
one process on the global batch.

ORPOTrainer runs the policy alone (no reference model) on the chosen and rejected sequences concatenated along the
batch, without labels, and builds its loss from the whole logits:

    loss = NLL(chosen) - mean over pairs of beta * logsigmoid(log odds(chosen) - log odds(rejected))

where NLL is ``nn.CrossEntropyLoss()``'s mean over every chosen token after the first (prompt and answer, padding
left out) and each sequence's log-prob is the mean over its answer tokens. In one process both means are over the
global batch. Here:

- **Odds-ratio term.** A mean over pairs: ``compute_loss`` rescales the rank's loss to its share of the mean over
  the global batch's pairs (dpo.py's ``global_mean_loss``; nd_parallel sums the dp gradients).
- **NLL term.** A mean over *tokens*, whose count differs between ranks: a mean of the ranks' own means would give
  each rank's tokens the weight 1 / (its count), not 1 / (the global count). ``concatenated_forward`` returns the
  rank's NLL times ``(local tokens / global tokens) * (global pairs / local pairs)``; the pair rescaling above then
  leaves exactly ``local NLL sum / global tokens``, whose sum over the dp ranks is the global token mean, for any
  split of the batch. The same value is what the logged ``nll_loss`` metric and the evaluation loss average over
  the dp ranks (``gather_for_metrics``): with equal pairs per rank, the global token mean as well. As in one
  process, each micro-batch is its own mean (the Trainer divides it by ``gradient_accumulation_steps``): the mean
  over the global micro-batch's tokens, not over the accumulated batch's.
- **Logits.** Under TP the head's plan gathers the vocabulary (a forward without labels gets the whole logits).
  Under CP each rank's forward holds its shard of the sequence; the CP hooks gather the logits back into the whole
  sequence *with* their gradient (``per_token_outputs``), every cp rank computes the same loss and backpropagates
  its own positions, as for DPO (token_outputs.py).

Refused before any collective (``refuse_trl_options``): pipeline parallelism (the loss needs the whole logits after
the forward, which a pipeline's schedule does not return) and the MoE router's auxiliary loss under dp or cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .dpo import global_mean_loss, is_trl_trainer, refuse_trl_options

PP_REASON = ("it builds its loss from the whole logits after the forward (the chosen NLL and each sequence's mean "
             "log-prob), which a pipeline's schedule does not return")


def is_orpo_trainer(trainer) -> bool:
    return is_trl_trainer(trainer, "ORPOTrainer")


def check_orpo_args(trainer, config) -> None:
    refuse_trl_options(trainer, config, "ORPOTrainer", [], pp_reason=PP_REASON)


def adopt_orpo(trainer, plugin) -> None:
    """Route this ORPOTrainer's loss through the global-batch means (see the module docstring)."""
    check_orpo_args(trainer, plugin.config)
    # ORPOTrainer's NLL targets: the chosen input ids where attention_mask is 1, shifted by one
    adopt_pair_loss(trainer, lambda batch: (batch["chosen_attention_mask"][:, 1:] == 1).sum())


def adopt_pair_loss(trainer, nll_tokens) -> None:
    """The loss of a trainer whose concatenated_forward returns its chosen NLL as item 4 (ORPO, CPO): the pair mean
    and the NLL's token mean (``nll_tokens(batch)``: this rank's NLL targets) taken over the global batch."""
    trainer._nd_parallel_nll_tokens = nll_tokens
    trainer.compute_loss = compute_loss.__get__(trainer)
    trainer.concatenated_forward = concatenated_forward.__get__(trainer)


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """The trainer class's compute_loss as this rank's share of the global batch's loss (module docstring)."""
    return global_mean_loss(self, model, inputs, return_outputs, inputs["chosen_input_ids"].shape[0])


def concatenated_forward(self, model, batch):
    """The trainer class's concatenated_forward, its chosen NLL (item 4) in the units of the global pair mean."""
    out = type(self).concatenated_forward(self, model, batch)
    config = self.nd_parallel.config
    if config.dp_size == 1:
        return out
    pairs = batch["chosen_input_ids"].shape[0]
    local = torch.stack([self._nd_parallel_nll_tokens(batch), torch.tensor(pairs, device=out[4].device)]).float()
    total = local.clone()
    dist.all_reduce(total, group=self.nd_parallel.mesh["dp"].get_group())
    nll = out[4] * (local[0] / total[0]) * (total[1] / local[1])
    return (*out[:4], nll, *out[5:])
