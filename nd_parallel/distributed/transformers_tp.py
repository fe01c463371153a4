"""Models sharded by transformers' own tensor parallelism (``from_pretrained(tp_plan="auto", ...)``), adopted.

Scripts written for Accelerate's ND parallelism load the model with ``tp_plan="auto"`` (and ``device_mesh=``), so it
arrives at ``prepare`` already split: DTensor parameters and a ``tp_forward`` installed on each planned module. Which
mesh transformers used depends on its version (5.24 ignores ``device_mesh`` and shards over every rank), and its
styles differ from torch's (``distributed/tensor_parallel.py`` says why ours are torch's). So the model is gathered
back, one parameter at a time, into plain tensors and its modules get their own ``forward`` again; every layout then
applies its own plan to it, exactly as to a model loaded without ``tp_plan``. The gather is a collective over
transformers' tp group and runs in ``parallelize`` after every check. Peak memory: the whole model per rank, as a
plain ``from_pretrained`` on every rank would hold (``plugin.from_pretrained`` reads only each rank's slices).
"""

from __future__ import annotations

import logging

import torch.nn as nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

_ATTRS = ("_tp_size", "_device_mesh", "_mesh_manager", "_is_distributed_loading_by_transformers")


def _hooked(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(module, "_is_hooked", False) and "tp_forward" in getattr(forward, "__qualname__", "")


def is_sharded_by_transformers(model: nn.Module) -> bool:
    """transformers' tensor parallelism installed its forward on some module (5.16 - 5.24 mark them _is_hooked)."""
    return any(_hooked(m) for m in model.modules())


def check_transformers_tp(model: nn.Module, has_adapter: bool) -> None:
    """What cannot be gathered back exactly, refused before any collective with the one-line change."""
    if has_adapter:
        raise ValueError(
            f"{type(model).__name__} was loaded with transformers' tp_plan and then wrapped with a PEFT adapter, "
            "whose layers were built on the TP shards; load it without tp_plan= / device_mesh= (nd_parallel splits "
            "the base layers and the adapter together at prepare)")
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and any(p.is_partial() for p in param.placements):
            raise ValueError(f"{name} is a partial-sum DTensor ({param.placements}); load the model without "
                             "tp_plan= / device_mesh= and let prepare() apply the tp_plan")


def gather_transformers_tp(model: nn.Module) -> dict[int, nn.Parameter]:
    """Replace every DTensor parameter by its full tensor and drop transformers' tp forwards; returns id of each
    sharded parameter -> its gathered replacement (an optimizer built on the shards is re-pointed through it).
    Tied parameters stay tied (each distinct DTensor is gathered once)."""
    gathered: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            if id(param) not in gathered:
                full = param.full_tensor().detach().clone()
                gathered[id(param)] = nn.Parameter(full, requires_grad=param.requires_grad)
            module._parameters[key] = gathered[id(param)]
        if _hooked(module):
            del module.forward  # the class's forward again
            module._is_hooked = False
    for attr in _ATTRS:  # transformers' record of its sharding, which no longer holds
        if attr in model.__dict__:
            model.__dict__[attr] = False if attr.startswith("_is_") else None
    logger.info("gathered %d parameters sharded by transformers' tp_plan; the layout applies its own plan",
                len(gathered))
    return gathered
