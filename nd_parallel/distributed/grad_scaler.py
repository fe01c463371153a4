"""Dynamic loss scaling for fp16 on every layout: ``torch.amp.GradScaler`` with one inf flag for the whole job.

torch's ``GradScaler`` decides to skip a step from the gradients *this process* holds. Under nd_parallel a rank
holds a different piece of the gradients on every mesh dim it is split on (an FSDP shard over dp, a TP slice, a
pipeline stage's parameters, its cp share summed in), so one rank's overflow must skip the step on every rank, or
the replicas part ways. ``MeshGradScaler`` therefore adds one all-reduce (MAX of the flag, over the world group:
it spans dp, tp, pp, cp and ep at once) to ``unscale_``; every rank then sees the same flag, skips or steps
together and moves its scale identically. ``ShardedGradScaler`` (torch's, for FSDP1) does the same over one
process group, but hands DTensor gradients to the unscale kernel; here each rank unscales its local shards, the
tensors it really holds.

The rest is torch's: ``scale`` multiplies the loss, ``step`` unscales if ``unscale_`` was not called and skips
on the flag, ``update`` halves the scale after an overflow and doubles it after ``growth_interval`` good steps.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState, _refresh_per_optimizer_state
from torch.distributed.tensor import DTensor


class MeshGradScaler(GradScaler):
    """``torch.amp.GradScaler`` whose inf flag is agreed on by every rank (see the module docstring).

    ``device``: where the scale lives and the flag is all-reduced (the accelerator's device: gloo on CPU,
    NCCL on CUDA). The scale is created at once, so that a pipeline stage that never computes a loss (whose
    ``scale`` is never called) still unscales and updates in step with the others."""

    def __init__(self, device: torch.device, **kwargs):
        super().__init__(device.type, **kwargs)
        self._place = device
        if self._enabled:
            self._lazy_init_scale_growth_tracker(device)

    def loss_scale(self) -> torch.Tensor:
        """The scale the loss of the current step is multiplied by (a 0-d fp32 tensor on ``device``; a copy, since
        ``update`` changes the scale in place)."""
        return self._scale.detach().clone()

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """Unscale this rank's local gradient tensors; {device: flag}, with at least the scale's device."""
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        # bitsandbytes' 8-bit optimizers step plain stand-ins that get their gradients only inside step()
        # (optimizer_8bit.step_local_shards): until then the gradients are the DTensor parameters'.
        stand_ins = {id(local): param for param, local in getattr(optimizer, "nd_parallel_local_shards", ())}
        for group in optimizer.param_groups:
            for param in group["params"]:
                param = stand_ins.get(id(param), param)
                if param.grad is None:
                    continue
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                if grad.dtype == torch.float16 and not allow_fp16:
                    raise ValueError("fp16 gradients on an fp32-master recipe: the parameters are not fp32 masters")
                grads[grad.device][grad.dtype].append(grad)
        flags = {self._place: found_inf}  # a rank without gradients still takes part in the all-reduce
        with torch.no_grad():
            for device, by_dtype in grads.items():
                flag = flags.setdefault(device, found_inf.to(device, copy=True))
                for tensors in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale.to(device))
        return flags

    def unscale_(self, optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        agreed = torch.stack([f.to(self._place) for f in flags.values()]).amax()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank that holds a different piece of the gradients
        for flag in flags.values():
            flag.copy_(agreed)

    def step(self, optimizer, *args, **kwargs):
        # Unscale (and agree on the flag) first also for optimizers that take the scale themselves (fused AdamW):
        # torch's path for those checks the flag of this rank's gradients only.
        if self._enabled and not self.unscaled(optimizer):
            self.unscale_(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def unscaled(self, optimizer) -> bool:
        """Whether ``unscale_`` already ran for ``optimizer`` since the last ``update``."""
        return self._per_optimizer_states[id(optimizer)]["stage"] is not OptState.READY

    def found_inf(self, optimizer) -> bool:
        """After ``unscale_``: whether any rank found an inf/NaN gradient (the same answer on every rank)."""
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return any(bool(f.item()) for f in flags.values())

    def forget_step(self) -> None:
        """A step skipped by someone else (nd_parallel's non-finite guard): back to READY, the scale unchanged."""
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
