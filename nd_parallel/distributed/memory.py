"""Memory options applied per decoder layer: activations offloaded to host memory, the MLP computed in tiles.

**Activation offloading.** Without activation checkpointing, each decoder layer's forward runs under saved-tensor
hooks (``torch.autograd.graph.saved_tensors_hooks``) that copy every tensor autograd saves to host memory and copy
it back when backward unpacks it. Our own pack/unpack rather than ``torch.autograd.graph.save_on_cpu``: that one
also copies the weights a matmul saves, which under FSDP2 are the layer's whole unsharded parameters (and under TP
DTensors); parameters and DTensors stay where they are here. With activation checkpointing a layer saves nothing
through autograd (torch's non-reentrant checkpoint keeps its inputs by reference for the recomputation), so the
checkpointed layer's tensor inputs are what moves: the layer is handed host copies and the recomputed region
copies them back (Axolotl's ``gradient_checkpointing: offload``). The copies are exact, so training is bit-equal;
on a CPU-only run the host is the device and nothing moves.

**Tiled MLP.** The MLP of each decoder layer (``hf.layer_mlp``, found from the module tree) runs over the sequence
in tiles, each under a non-reentrant checkpoint: forward keeps one tile's intermediate activations at a time and
only each tile's input, backward recomputes one tile at a time. An MLP is per-token, so the outputs are the
untiled ones; the weight gradient is a sum over tiles instead of one matmul over all tokens, which in fp32 differs
from the untiled sum by reduction order only (tests/unit/test_memory_options.py measures it).
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from nd_parallel.models.hf import decoder_layers, layer_mlp, text_config

from .activation_checkpoint import CheckpointedForward

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- activation offloading
def _movable(t) -> bool:
    return (isinstance(t, torch.Tensor) and not isinstance(t, (nn.Parameter, DTensor))
            and t.device.type != "cpu")


def _to_host(t: torch.Tensor):
    if not _movable(t):
        return None, t
    pin = t.device.type == "cuda"
    # empty_like keeps the strides of a dense tensor (a permuted one included): a compiled (inductor) backward
    # asserts the strides of what its forward saved, and a contiguous copy would fail there.
    host = torch.empty_like(t, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)  # same stream as the copy back: ordered without a sync
    return t.device, host


def _to_device(packed):
    device, t = packed
    return t if device is None else t.to(device, non_blocking=True)


class OffloadedForward:
    """Stands in for a decoder layer's ``forward``: what the layer keeps for backward lives in host memory."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        if not isinstance(self.forward, CheckpointedForward):
            with torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device):
                return self.forward(*args, **kwargs)
        # Checkpointed: the region's tensor inputs are what the layer keeps. It gets host copies and copies them
        # back inside the region (again when it is recomputed); gradients flow back through both copies.
        devices = {i: a.device for i, a in enumerate(args) if _movable(a)}
        if not devices:
            return self.forward(*args, **kwargs)
        host_args = [_ToHost.apply(a) if i in devices else a for i, a in enumerate(args)]
        inner = self.forward.forward

        def on_device(*moved, **kw):
            return inner(*(a.to(devices[i]) if i in devices else a for i, a in enumerate(moved)), **kw)

        return self.forward.run(on_device, *host_args, **kwargs)


class _ToHost(torch.autograd.Function):
    """A host copy of ``x``; its gradient goes back to ``x``'s device."""

    @staticmethod
    def forward(ctx, x):
        ctx.device = x.device
        return _to_host(x)[1]

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.device)


def apply_activation_offloading(part: nn.Module) -> int:
    """Offload what every decoder layer of ``part`` keeps for backward to host memory. Returns the layers wrapped.

    Applied after activation checkpointing (it wraps the checkpointed forward) and before FSDP (whose hooks stay
    outside, in ``__call__``)."""
    wrapped = 0
    for layer in decoder_layers(part):
        if isinstance(layer.forward, OffloadedForward):
            continue
        # The layer's current forward: its class's, or the compiled / checkpointed one set on the instance (the
        # class's forward here would silently drop a compiled layer's compilation).
        layer.forward = OffloadedForward(layer.forward)
        wrapped += 1
    logger.info("applied activation offloading to host memory to %d layers", wrapped)
    return wrapped


# ------------------------------------------------------------------------------------------------- tiled MLP
class TiledForward:
    """Stands in for an MLP's ``forward``: the sequence (dim -2) in tiles, each checkpointed."""

    def __init__(self, forward, num_shards: int | None, hidden_size: int):
        self.forward = forward
        self.num_shards = num_shards
        self.hidden_size = hidden_size

    def tiles(self, tokens: int) -> int:
        return max(1, min(tokens, self.num_shards or math.ceil(tokens / self.hidden_size)))

    def __call__(self, x, *args, **kwargs):
        if args or kwargs or not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.dim() < 2:
            return self.forward(x, *args, **kwargs)  # not the plain [..., s, h] call this tiling is for
        n = self.tiles(x.shape[-2])
        if n == 1:
            return self.forward(x)
        parts = torch.tensor_split(x, n, dim=-2)
        if torch.is_grad_enabled():
            outs = [checkpoint(self.forward, p, use_reentrant=False) for p in parts]
        else:
            outs = [self.forward(p) for p in parts]
        return torch.cat(outs, dim=-2)


def check_tiled_mlp(model: nn.Module) -> None:
    """Refuse tiled_mlp for a model whose decoder layers have no per-token MLP to tile (before any collective)."""
    hidden = text_config(model).hidden_size
    missing = sorted({type(layer).__name__ for layer in decoder_layers(model) if layer_mlp(layer, hidden) is None})
    if not decoder_layers(model) or missing:
        raise ValueError(f"tiled_mlp=True: {type(model).__name__} has decoder layers ({', '.join(missing) or 'none'})"
                         " without exactly one per-token MLP of Linears (a mixture of experts, or an MLP that is not "
                         "made of nn.Linear); use tiled_mlp=False for this model")


def apply_tiled_mlp(part: nn.Module, num_shards: int | None, hidden_size: int) -> int:
    """Compute every decoder layer's MLP of ``part`` in sequence tiles. Returns the number of MLPs tiled."""
    tiled = 0
    for layer in decoder_layers(part):
        found = layer_mlp(layer, hidden_size)
        if found is None or isinstance(found[1].forward, TiledForward):
            continue
        mlp = found[1]
        mlp.forward = TiledForward(functools.partial(type(mlp).forward, mlp), num_shards, hidden_size)
        tiled += 1
    logger.info("applied tiled MLP (%s tiles) to %d layers", num_shards or "ceil(tokens / hidden)", tiled)
    return tiled


def apply_memory_options(part: nn.Module, config) -> None:
    """Tiled MLP, then activation offloading (around the checkpointed layer), on one model part, in place."""
    if config is None:
        return
    if config.tiled_mlp:
        apply_tiled_mlp(part, config.tiled_mlp_num_shards, _hidden_size(part))
    if config.activation_offloading:
        apply_activation_offloading(part)


def _hidden_size(part: nn.Module) -> int:
    """The model's hidden size, also for a pipeline stage (which may carry no ``config`` of its own: the first
    submodule that does, an attention module in every HF family, answers)."""
    holder = next((m for m in part.modules() if hasattr(getattr(m, "config", None), "to_dict")), None)
    if holder is None:
        raise ValueError(f"tiled_mlp=True: no module of {type(part).__name__} carries the model's config, so the "
                         "MLP cannot be told from the other Linears; use tiled_mlp=False")
    return text_config(holder).hidden_size
