"""Non-finite loss or gradient norm: stop with the step, rank and parameter where it first appeared, or skip the
optimizer step (``skip_nonfinite_steps``); and never write a checkpoint that holds a NaN or Inf.

The loss (``out.loss``) and the clipped norm are global: the same number on every rank. So every rank takes the same
branch, and the collective that locates the culprit (one ``all_gather_object``) runs only on the bad path; a healthy
step pays one host sync of a two-element tensor.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger("nd_parallel")


class NonFiniteError(FloatingPointError):
    """A NaN/Inf loss, gradient norm or checkpoint value; the message names the step, rank and parameter."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values as a plain tensor. A quantized optimizer state (torchao's 8-bit/4-bit AdamW keep their
    moments as tensor subclasses that implement few ops, not isfinite) is read through its own dequantize()."""
    t = t.to_local() if isinstance(t, DTensor) else t
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and callable(getattr(t, "dequantize", None)):
        t = t.dequantize()
    return t


def first_nonfinite(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor (this rank's shard) holding a NaN or Inf, or None."""
    for name, tensor in named:
        if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(_local(tensor)).all()):
            return name
    return None


def locate(named: list[tuple[str, torch.Tensor]], distributed: bool) -> tuple[int, str] | None:
    """(lowest rank, its first parameter) with a non-finite value; a collective when ``distributed``."""
    mine = first_nonfinite(named)
    if not distributed:
        return (0, mine) if mine else None
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    for rank, name in enumerate(found):
        if name is not None:
            return rank, name
    return None


class NonFiniteGuard:
    """Watches each step's loss and gradient norm. ``skip`` = how many non-finite steps may be skipped."""

    def __init__(self, skip: int, named_grads, distributed: bool):
        self.skip_left = skip
        self.skipped = 0
        self._named_grads = named_grads  # () -> [(HF name, grad)] of this rank's parameters
        self._distributed = distributed
        self._loss: torch.Tensor | None = None
        self.skip_next_step = False

    def observe_loss(self, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def check(self, step: int, norm: torch.Tensor | None) -> None:
        """After backward (from clip_grad_norm_, or the optimizer step when no norm was taken); raises or marks the
        coming optimizer step as skipped."""
        loss, self._loss = self._loss, None
        present = {k: v for k, v in (("loss", loss), ("grad norm", norm)) if v is not None}
        if not present:
            return
        numbers = torch.stack([v.detach().float().reshape(()) for v in present.values()]).tolist()  # one sync
        if all(math.isfinite(x) for x in numbers):
            return
        where = locate([(n, g) for n, g in self._named_grads()], self._distributed)
        origin = (f"first non-finite gradient on rank {where[0]} in {where[1]}" if where else
                  "every gradient is finite: the forward pass produced it (check the inputs and the loss)")
        what = ", ".join(f"{k}={v}" for k, v in zip(present, numbers))
        if self.skip_left > 0:
            self.skip_left -= 1
            self.skipped += 1
            self.skip_next_step = True
            logger.warning("non-finite values at optimizer step %d (%s; %s): step skipped, %d more may be skipped "
                           "(skip_nonfinite_steps)", step + 1, what, origin, self.skip_left)
            return
        raise NonFiniteError(
            f"non-finite values at optimizer step {step + 1} ({what}); {origin}. Lower the learning rate, use bf16 "
            "instead of fp16, check the data, or set skip_nonfinite_steps: N to skip up to N such steps")


def check_state_finite(named: list[tuple[str, torch.Tensor]], distributed: bool, step: int) -> None:
    """Refuse to write a checkpoint holding NaN/Inf (model or optimizer state); every rank raises the same error."""
    where = locate(named, distributed)
    if where is not None:
        raise NonFiniteError(
            f"refusing to save a checkpoint at step {step}: rank {where[0]} holds a non-finite value in {where[1]}; "
            "the previous checkpoint stays the latest. Resume from it with a lower learning rate, or set "
            "skip_nonfinite_steps to skip the steps that produce such values")
