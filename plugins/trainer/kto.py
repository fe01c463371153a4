"""TRL's ``KTOTrainer`` (1.16) under FSDP2 / HSDP / DDP / TP / CP / EP: its loss the mean over the global batch.

KTOTrainer scores each (prompt, completion, label) example with the fused LM head, as DPOTrainer does (dpo.py: the
same log-prob path, CP gather and reference handling), and its loss is the mean over this rank's examples of a
per-example function of the example's log-ratio and the batch's KL estimate. Here:

- **Loss.** Rescaled to this rank's share of the mean over the global batch's examples (``global_mean_loss``), as
  nd_parallel sums the data-parallel gradients.
- **KL estimate.** KTOTrainer averages ``policy - reference`` log-probs of mismatched (prompt, completion) pairs over
  this rank's batch, then over ``accelerator.gather_for_metrics`` (nd_parallel: the dp ranks), detached: with equal
  per-rank batches that is the global batch's mean, as in one process. Which completion pairs with which prompt is
  fixed when TRL prepares the dataset (completions rotated within blocks of ``per_device_train_batch_size`` rows),
  so it depends on the per-device batch, as under TRL's own DDP. At an epoch's end, where the data leave the last
  global batch short, Accelerate's gather_for_metrics keeps the first ranks' values only (one per rank, read as
  samples), so that step's estimate is the mean over those ranks, again as under TRL's own DDP; runs that stay
  within an epoch (the parity rows) are exact.

Refused before any collective (``refuse_trl_options``): pipeline parallelism, ``precompute_ref_log_probs``,
``sync_ref_model``, the MoE router's auxiliary loss under dp or cp.
"""

from __future__ import annotations

from .dpo import global_mean_loss, is_trl_trainer, refuse_trl_options


def is_kto_trainer(trainer) -> bool:
    return is_trl_trainer(trainer, "KTOTrainer")


def check_kto_args(trainer, config) -> None:
    refuse_trl_options(trainer, config, "KTOTrainer", [])


def adopt_kto(trainer, plugin) -> None:
    """Route this KTOTrainer's loss through the global-batch mean (see the module docstring)."""
    check_kto_args(trainer, plugin.config)
    trainer.compute_loss = compute_loss.__get__(trainer)


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """KTOTrainer.compute_loss, its loss the mean over the global batch's examples (module docstring)."""
    return global_mean_loss(self, model, inputs, return_outputs, len(inputs["label"]))
