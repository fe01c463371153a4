"""fp16's dynamic loss scaling through Accelerate's own path, made to hold under every layout.

Accelerate's fp16 path is: ``accelerator.scaler`` (a GradScaler), ``accelerator.backward`` multiplying the loss
by its scale, ``clip_grad_norm_`` / ``unscale_gradients`` unscaling first, and ``AcceleratedOptimizer`` stepping
through the scaler (skipping on inf/NaN, ``step_was_skipped``; the LR scheduler then skips too). On CPU Accelerate
builds no scaler at all, and on GPU its GradScaler decides from the gradients of one process. The plugin keeps the
path and swaps the scaler for ``MeshGradScaler``, whose inf flag is agreed on by every rank, and hands its scale to
the pipeline's loss, since under PP backward runs inside the schedule, not in ``accelerator.backward``.
"""

from __future__ import annotations

from nd_parallel.distributed.grad_scaler import MeshGradScaler
from nd_parallel.distributed.pipeline.torch_backend import PipelineModel


def install_scaler(accelerator) -> MeshGradScaler | None:
    """For ``mixed_precision='fp16'``: a MeshGradScaler as ``accelerator.scaler`` (GradScalerKwargs honoured)."""
    if accelerator.mixed_precision != "fp16":
        return None
    handler = getattr(accelerator, "scaler_handler", None)
    scaler = MeshGradScaler(accelerator.device, **(handler.to_kwargs() if handler is not None else {}))
    accelerator.scaler = scaler  # accelerator.backward scales the loss with it
    return scaler


def reach_pipeline(model, scaler: MeshGradScaler | None) -> None:
    """Under PP the schedule computes the loss and runs backward inside ``model(**batch)``: scale it there."""
    if scaler is None or not scaler.is_enabled():
        return
    for module in model.modules():
        if isinstance(module, PipelineModel):
            module.loss.grad_scale = scaler.loss_scale


def unscale(scaler: MeshGradScaler | None, optimizers) -> bool:
    """Unscale the gradients of ``optimizers`` (Accelerate's wrappers or torch's) once per step; whether any rank
    found an inf/NaN, i.e. whether the scaler will skip this step (the same answer on every rank)."""
    if scaler is None or not scaler.is_enabled():
        return False
    overflow = False
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        if not scaler.unscaled(inner):  # clip after unscale_gradients: unscaling twice would be wrong
            scaler.unscale_(inner)
        overflow = scaler.found_inf(inner) or overflow
    return overflow


def drop_step(scaler: MeshGradScaler | None) -> None:
    """The non-finite guard skipped an optimizer step without the scaler: forget this step's unscale, keep the
    scale (what ``update`` does at its end, minus the scale change)."""
    if scaler is not None and scaler.is_enabled():
        scaler.forget_step()
