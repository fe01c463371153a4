"""Axolotl's learning-rate schedules that transformers' ``lr_scheduler_type`` cannot name.

``lr_quadratic_warmup: true`` (with ``lr_scheduler: cosine``): Axolotl 0.19's
``get_cosine_schedule_with_quadratic_warmup`` (axolotl/utils/schedulers.py), the same numbers: during warm-up the
LR factor is ``(step / warmup)^2`` instead of ``step / warmup``, then the half cosine down to 0. Axolotl builds it
in its Trainer's ``create_scheduler`` with ``args.get_warmup_steps`` (warmup_steps, or a share of the steps); the
rank program gives the Trainer the same ``create_scheduler`` (``use_quadratic_warmup``).
"""

from __future__ import annotations

import math
import types
from functools import partial

from torch.optim.lr_scheduler import LambdaLR


def quadratic_warmup_factor(step: int, *, num_warmup_steps: int, num_training_steps: int,
                            num_cycles: float = 0.5) -> float:
    """The LR factor at `step` (Axolotl's _get_cosine_schedule_with_quadratic_warmup_lr_lambda)."""
    if step < num_warmup_steps:
        return (float(step) / float(max(1, num_warmup_steps))) ** 2
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def cosine_with_quadratic_warmup(optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    # a partial, not a closure: LambdaLR's state_dict (in the sharded checkpoint) keeps a partial's __dict__ only
    return LambdaLR(optimizer, partial(quadratic_warmup_factor, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps))


def _create_scheduler(trainer, num_training_steps: int, optimizer=None):
    """Trainer.create_scheduler with Axolotl's quadratic warm-up (as its SchedulerMixin builds it)."""
    if trainer.lr_scheduler is None:
        trainer.lr_scheduler = cosine_with_quadratic_warmup(
            optimizer if optimizer is not None else trainer.optimizer,
            num_warmup_steps=trainer.args.get_warmup_steps(num_training_steps), num_training_steps=num_training_steps)
        trainer._created_lr_scheduler = True  # transformers 5.24: builds it once (create_optimizer_and_scheduler)
    return trainer.lr_scheduler


def use_quadratic_warmup(trainer) -> None:
    """This Trainer instance builds Axolotl's cosine schedule with quadratic warm-up (no class is patched)."""
    if trainer.args.lr_scheduler_type != "cosine":  # the config stage refuses it with another schedule
        raise ValueError(f"lr_quadratic_warmup needs lr_scheduler_type='cosine', got {trainer.args.lr_scheduler_type}")
    trainer.create_scheduler = types.MethodType(_create_scheduler, trainer)
