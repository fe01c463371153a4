"""TRL's ``RewardTrainer`` (1.16) under FSDP2 / HSDP / DDP / TP / CP: its loss the mean over the global batch's pairs.

RewardTrainer scores each sequence with a sequence-classification model (one logit, pooled at the last non-pad
token) and its loss is the mean over this rank's pairs of ``-logsigmoid(r_chosen - r_rejected [- margin])``, plus
``center_rewards_coefficient * mean((r_chosen + r_rejected)^2)``, also a mean over the pairs. nd_parallel sums the
data-parallel gradients, so each rank's loss is rescaled to its share of the mean over the global batch's pairs
(dpo.py's ``global_mean_loss``): the value and gradients one process gets on the concatenated batch. tp peers hold
the same pairs. Its metrics (rewards, accuracy, margin) go through ``accelerator.gather`` / ``gather_for_metrics``,
which nd_parallel gathers over the dp ranks only: the global batch's, as in one process.

The score head is a plain Linear outside the model's tensor-parallel plan: replicated under TP (every tp rank
computes the same gradient from the same whole hidden states), sharded by FSDP with the root group.

A process reward model (Axolotl's ``process_reward_model``) is a token-classification model trained by the
Trainer's own loss: the global-token mean (``distributed/loss.py``, labels not shifted), nothing to turn here.

Under CP every rank scores the whole sequence's pooled token (``context_parallel/pooled_head.py`` gathers it from the
rank that holds it) and computes the same loss, backpropagating its own tokens' share. Refused before any collective
(``distributed/classification.py``): pipeline parallelism, whose last stage does not get the ``input_ids`` the head
pools by; CP for a token head (it shifts the labels).
"""

from __future__ import annotations

from nd_parallel.distributed.classification import check_classification_layout

from .dpo import global_mean_loss, is_trl_trainer


def is_reward_trainer(trainer) -> bool:
    return is_trl_trainer(trainer, "RewardTrainer")


def check_reward_args(trainer, config) -> None:
    check_classification_layout(trainer.model, config)  # at the Trainer's __init__: before any collective


def adopt_reward(trainer, plugin) -> None:
    """Route this RewardTrainer's loss through the global-pair mean (see the module docstring)."""
    check_reward_args(trainer, plugin.config)
    trainer.compute_loss = compute_loss.__get__(trainer)


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """RewardTrainer.compute_loss, its loss the mean over the global batch's pairs (module docstring)."""
    # chosen and rejected sequences are concatenated along the batch (DataCollatorForPreference): half are pairs
    return global_mean_loss(self, model, inputs, return_outputs, inputs["input_ids"].shape[0] // 2)
