"""Axolotl's learning-rate schedules and optimizers that transformers' ``lr_scheduler_type`` / ``optim`` cannot name.

``optimizer: muon``: Axolotl's Muon (Moonlight's recipe: Muon on the 2-D hidden matrices, AdamW on the rest;
nd_parallel/distributed/muon.py, which orthogonalizes sharded matrices whole), built by the Trainer's
``create_optimizer`` (``use_muon``) with the YAML's learning rate, weight decay and, as Axolotl passes them, Adam's
betas when both ``adam_beta1`` and ``adam_beta2`` are set and ``adam_epsilon`` when set.

``lr_quadratic_warmup: true`` (with ``lr_scheduler: cosine``): Axolotl 0.19's
``get_cosine_schedule_with_quadratic_warmup`` (axolotl/utils/schedulers.py), the same numbers: during warm-up the
LR factor is ``(step / warmup)^2`` instead of ``step / warmup``, then the half cosine down to 0. Axolotl builds it
in its Trainer's ``create_scheduler`` with ``args.get_warmup_steps`` (warmup_steps, or a share of the steps); the
rank program gives the Trainer the same ``create_scheduler`` (``use_quadratic_warmup``).

``cosine_constant_lr_ratio`` (with ``cosine_min_lr_ratio`` and ``lr_scheduler: cosine``): Axolotl 0.19's
``get_cosine_schedule_with_warmup_decay_constant``: after the linear warm-up the half cosine falls from the peak to
``learning_rate x cosine_min_lr_ratio`` by step ``int(steps x cosine_constant_lr_ratio)`` and stays there
(``use_constant_tail``). The config stage refuses the combinations Axolotl silently ignores (extras.py).
"""

from __future__ import annotations

import math
import types
from functools import partial

from torch.optim.lr_scheduler import LambdaLR, LRScheduler


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


def constant_tail_factor(step: int, *, num_warmup_steps: int, num_training_steps: int, constant_lr_ratio: float,
                         min_lr_ratio: float, num_cycles: float = 0.5) -> float:
    """The LR factor at `step` (Axolotl's _get_cosine_schedule_with_warmup_decay_constant_lr_lambda)."""
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    end = int(num_training_steps * constant_lr_ratio)  # the cosine reaches the floor here, then stays
    progress = float(min(step, end) - num_warmup_steps) / float(max(1, end - num_warmup_steps))
    return max(0.0, (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))) + \
        min_lr_ratio


def cosine_with_constant_tail(optimizer, num_warmup_steps: int, num_training_steps: int, constant_lr_ratio: float,
                              min_lr_ratio: float) -> LambdaLR:
    return LambdaLR(optimizer, partial(constant_tail_factor, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps, constant_lr_ratio=constant_lr_ratio,
                                       min_lr_ratio=min_lr_ratio))


def _use_schedule(trainer, build) -> None:
    """This Trainer instance builds `build(optimizer, num_warmup_steps, num_training_steps)` in its create_scheduler,
    as Axolotl's SchedulerMixin does (no class is patched)."""
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = build(optimizer if optimizer is not None else self.optimizer,
                                      self.args.get_warmup_steps(num_training_steps), num_training_steps)
            self._created_lr_scheduler = True  # transformers 5.24: builds it once (create_optimizer_and_scheduler)
        return self.lr_scheduler

    trainer.create_scheduler = types.MethodType(create_scheduler, trainer)


class Rex(LRScheduler):
    """Axolotl's ``lr_scheduler: rex`` (its RexLR, the reflected-exponential schedule of arXiv 2107.04197): a linear
    warm-up, then the factor ``m + (1 - m) * z / (0.1 + 0.9 z)`` with ``z`` the share of the post-warm-up steps left
    and ``m = min_lr / max_lr``; ``min_lr`` from the last step on. Its first step is LRScheduler's own, as in
    Axolotl (so a warm-up starts at 1 / warmup, not 0)."""

    def __init__(self, optimizer, max_lr: float, min_lr: float, total_steps: int, num_warmup_steps: int = 0):
        if min_lr > max_lr or num_warmup_steps > total_steps:
            raise ValueError(f"rex: min_lr={min_lr} above max_lr={max_lr}, or {num_warmup_steps} warm-up steps of "
                             f"{total_steps}")
        self.min_lr, self.max_lr, self.total_steps, self.num_warmup_steps = min_lr, max_lr, total_steps, \
            num_warmup_steps
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch=0)

    def get_lr(self):
        step = self.last_epoch
        if 1 <= step <= self.num_warmup_steps:
            return [lr * step / self.num_warmup_steps for lr in self.base_lrs]
        after, left = step - self.num_warmup_steps, self.total_steps - self.num_warmup_steps
        if after >= left or after == -1 or left <= 0:
            return [self.min_lr for _ in self.base_lrs]
        z = (left - after % left) / left
        floor = self.min_lr / self.max_lr
        return [lr * (floor + (1.0 - floor) * (z / (0.1 + 0.9 * z))) for lr in self.base_lrs]


def use_alternate(trainer, t) -> None:
    """Axolotl's ``lr_scheduler: rex`` / ``one_cycle`` (its alternate_lr_scheduler_type, built in create_scheduler):
    rex to learning_rate x cosine_min_lr_ratio (0 without it); one_cycle is torch's OneCycleLR with max_lr the
    learning rate, pct_start the warm-up's share and cosine annealing unless lr_scheduler_kwargs say otherwise."""
    from torch.optim.lr_scheduler import OneCycleLR

    lr, kwargs = trainer.args.learning_rate, dict(t.lr_scheduler_kwargs or {})
    if t.lr_scheduler == "rex":
        floor = lr * t.cosine_min_lr_ratio if t.cosine_min_lr_ratio is not None else 0
        _use_schedule(trainer, lambda opt, warmup, total: Rex(opt, lr, floor, total, warmup))
    else:
        _use_schedule(trainer, lambda opt, warmup, total: OneCycleLR(opt, max_lr=lr, total_steps=total, **{
            "pct_start": warmup / total, "anneal_strategy": "cos", **kwargs}))


def use_quadratic_warmup(trainer) -> None:
    """This Trainer instance builds Axolotl's cosine schedule with quadratic warm-up."""
    if trainer.args.lr_scheduler_type != "cosine":  # the config stage refuses it with another schedule
        raise ValueError(f"lr_quadratic_warmup needs lr_scheduler_type='cosine', got {trainer.args.lr_scheduler_type}")
    _use_schedule(trainer, cosine_with_quadratic_warmup)


def use_constant_tail(trainer, constant_lr_ratio: float, min_lr_ratio: float) -> None:
    """This Trainer instance builds Axolotl's cosine to a floor with a constant tail (cosine_constant_lr_ratio)."""
    _use_schedule(trainer, partial(cosine_with_constant_tail, constant_lr_ratio=constant_lr_ratio,
                                   min_lr_ratio=min_lr_ratio))


def use_muon(trainer, t) -> None:
    """The Trainer builds Muon (see the module docstring) where it would build its AdamW."""
    from nd_parallel.distributed.muon import Muon, muon_param_groups

    adam = {"betas": (t.adam_beta1, t.adam_beta2)} if t.adam_beta1 and t.adam_beta2 else {}
    adam |= {"eps": t.adam_epsilon} if t.adam_epsilon else {}

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            groups = muon_param_groups((self.model if model is None else model).named_parameters())
            self.optimizer = Muon(groups, lr=self.args.learning_rate, weight_decay=self.args.weight_decay, **adam)
        return self.optimizer

    trainer.create_optimizer = types.MethodType(create_optimizer, trainer)


class JaggedRestarts(LRScheduler):
    """Axolotl's jagged restarts (``jagged_restart_steps`` / ``_warmup_steps`` / ``_anneal_steps``, its
    JaggedLRRestartScheduler): the inner schedule's LR times a factor that, from the first anneal on, falls linearly to
    ``min_scale`` over the ``anneal`` steps before each restart and climbs back over the ``warmup`` steps after it.
    As in Axolotl this scheduler counts one step ahead of the inner one it was built on (LRScheduler's own first
    step), and ``min_scale`` is cosine_min_lr_ratio or 0.001."""

    def __init__(self, optimizer, inner, every: int, warmup: int, anneal: int = 1, min_scale: float = 0.001):
        self.inner, self.every, self.warmup, self.anneal, self.min_scale = inner, every, warmup, anneal, min_scale
        super().__init__(optimizer, inner.last_epoch)

    def factor(self, step: int) -> float:
        if step < self.every - self.anneal:
            return 1.0
        into = step % self.every
        if into < self.warmup:
            t = min(1.0, into / self.warmup)
        elif into > self.every - self.anneal:
            t = min(1.0, (self.every - into) / self.anneal)
        else:
            t = 1.0
        return t * (1 - self.min_scale) + self.min_scale

    def get_lr(self):
        self.inner.last_epoch = self.last_epoch
        scale = self.factor(self.last_epoch)
        return [lr * scale for lr in self.inner.get_lr()]

    def state_dict(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "inner")}
        return {**state, "inner_state": self.inner.state_dict()}

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        self.inner.load_state_dict(state.pop("inner_state"))
        self.__dict__.update(state)


def use_jagged_restarts(trainer, t) -> None:
    """The Trainer's scheduler, whichever it builds, wrapped in JaggedRestarts (Axolotl wraps it in its
    create_scheduler whenever jagged_restart_steps is set, with or without relora)."""
    build = trainer.create_scheduler

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = build(num_training_steps, optimizer)
        if not isinstance(scheduler, JaggedRestarts):
            self.lr_scheduler = JaggedRestarts(
                optimizer if optimizer is not None else self.optimizer, scheduler, t.jagged_restart_steps,
                t.jagged_restart_warmup_steps or 10, t.jagged_restart_anneal_steps or 1,
                min_scale=t.cosine_min_lr_ratio or 0.001)
        return self.lr_scheduler

    trainer.create_scheduler = types.MethodType(create_scheduler, trainer)
