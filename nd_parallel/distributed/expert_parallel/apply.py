"""Split every MoE layer's experts over the ep ranks, and route each call through the all-to-all dispatch.

The stacked expert weights (``[num_experts, ...]``) become DTensors ``Shard(0)`` on the ep mesh, each rank holding
its contiguous block of ``num_experts / ep`` experts. A DTensor rather than a plain local slice because then every
part of the library that already handles sharded parameters handles these too, with no EP branch: FSDP2 shards
them further over the dp ranks left (its FSDP x EP support concatenates the two meshes), the gradient norm sums
their squares over ep, and the full state dict, DCP checkpoints and ``save_model`` see the whole HF tensor.

The experts module keeps its own forward (eager, grouped_mm, ...) for the computation: it is called on the rows
this rank received, with its local weights and ``num_experts`` set to the local count for the call.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from nd_parallel.config import ParallelismConfig
from nd_parallel.models import moe

from .dispatch import combine, dispatch, plan_routing

logger = logging.getLogger(__name__)


@dataclass
class _ExpertParallelState:
    group: Any
    per_rank: int
    stacked: tuple[str, ...]
    forward: Any  # the experts module's own forward (unbound)


def check_model(model: nn.Module, config: ParallelismConfig) -> None:
    """ep_size against the model, before any collective: a MoE model whose expert count ep_size divides."""
    ep = config.ep_size
    if ep == 1:
        return
    count = moe.num_experts(model)
    found = moe.expert_modules(model) if count is not None else []
    if count is None or not found:
        what = ("declares no experts in its config" if count is None else
                f"declares {count} experts, but no module both holds weights stacked over them and takes the routing "
                "(hidden_states, top_k_index, top_k_weights), which the all-to-all dispatch needs (llama4's experts "
                "take the routed rows only)")
        raise ValueError(
            f"ep_size={ep} needs a mixture-of-experts model, but {type(model).__name__} {what}; use ep_size=1 "
            "(its ranks then shard the dense model with FSDP)")
    if count % ep:
        shard = config.dp_shard_size
        fits = [d for d in range(1, count + 1) if count % d == 0 and (shard == -1 or shard % d == 0)]
        raise ValueError(
            f"ep_size={ep} does not divide the {count} experts of {type(model).__name__} (each ep rank holds "
            f"num_experts / ep_size of them); use ep_size in {fits}")


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split the experts of ``model`` in place over ``ep_mesh``; returns the experts modules (for FSDP)."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    count = moe.num_experts(model)
    per_rank = count // ep
    modules = []
    for found in moe.expert_modules(model):
        module = found.module
        for name in found.stacked:
            full = getattr(module, name)
            local = full.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        state = _ExpertParallelState(ep_mesh.get_group(), per_rank, found.stacked, type(module).forward)
        module._nd_parallel_ep = state
        module.forward = MethodType(_expert_parallel_forward, module)
        modules.append(module)
    logger.info("applied EP over %d ranks to %d MoE layers (%d of %d experts per rank)", ep, len(modules), per_rank,
                count)
    return modules


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules ``apply_ep`` split in ``model`` (empty without EP)."""
    return [m for m in model.modules() if hasattr(m, "_nd_parallel_ep")]


@contextlib.contextmanager
def _local_view(module: nn.Module, state: _ExpertParallelState):
    """The module as its own forward expects it: this rank's experts as plain tensors, numbered from 0.

    ``to_local`` is differentiable, so gradients reach the DTensor parameters (or FSDP's unsharded ones).
    """
    saved = {name: module._parameters[name] for name in state.stacked}
    saved_count = getattr(module, "num_experts", None)
    try:
        for name, param in saved.items():
            module._parameters[name] = param.to_local() if isinstance(param, DTensor) else param
        if saved_count is not None:
            module.num_experts = state.per_rank
        yield
    finally:
        module._parameters.update(saved)
        if saved_count is not None:
            module.num_experts = saved_count


def _expert_parallel_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """Same call and result as the experts module's own forward, with the experts spread over the ep ranks."""
    state: _ExpertParallelState = self._nd_parallel_ep
    routing = plan_routing(top_k_index, state.per_rank, state.group)
    rows, ids = dispatch(hidden_states, routing, top_k_index.shape[-1], state.group)  # [R, H], [R]
    with _local_view(self, state):
        # Weight 1 here; the router's weights are applied where the token lives (combine), so they need no trip.
        out = state.forward(self, rows, ids[:, None], top_k_weights.new_ones((rows.shape[0], 1)))
        if rows.shape[0] == 0:
            # No token for this rank's experts: still give their weights a (zero) gradient, so that FSDP's
            # gradient reduction sees the same parameters on every rank.
            out = out + sum(self._parameters[name].sum() for name in state.stacked) * 0
    return combine(out, routing, top_k_weights, state.group)
