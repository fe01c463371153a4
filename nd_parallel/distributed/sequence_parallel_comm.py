"""Sequence parallelism's collectives around a TP region (sequence_parallel.py): the gather of a region's input, whose
backward is **one reduce-scatter** where that is exact, and the colwise style that leaves its input gradient partial.

torch's styles give a region's input gradient back the way ColwiseParallel's input hook made it: ``from_local(
Replicate)`` redistributes each colwise linear's (Partial) input gradient to Replicate, one all-reduce per linear,
and the gather's backward then slices. Megatron sums the partial gradients of a region's colwise inputs locally
and reduce-scatters once. No torch style does that for an input shared by several modules, so the two autograd
Functions below do: the gather hands its output to the region tagged with a ``_RegionCall``, a colwise linear fed
exactly that tensor keeps its input gradient Partial, and the gather's backward reduce-scatters the sum. That is
exact only if every gradient reaching the gathered tensor is such a partial sum; anything else inside the region
that reads it (a norm, a residual, a reshape or copy before the linear) gives a replicated gradient, and summing it
over tp would count it tp times. The region's forward post-hook checks that on the autograd graph
(``_only_colwise_uses``) before any backward runs and, where it fails, switches that call back to the per-linear
all-reduce and the slicing gather.

The forward all-gather is one custom op (``nd_parallel::sp_all_gather``), not DTensor's functional collectives:
selective activation checkpointing (activation_checkpoint.py) saves every functional collective's output, and the
gathered [b, s, h] input of each region is exactly what SP should not hold. As one op outside the communication
namespaces the policy recomputes it: backward re-gathers the region's input from the saved shard, as Megatron's
sequence-parallel linears do; every tp rank recomputes the same layer at the same point, so the collectives match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

# torch 2.13 renamed all_gather_into_tensor (deprecated, same signature) to all_gather_single
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@torch.library.custom_op("nd_parallel::sp_all_gather", mutates_args=())
def sp_all_gather(x: torch.Tensor, group_name: str, full_len: int) -> torch.Tensor:
    """This rank's [b, s_r, ...] (torch.chunk sizes of ``full_len``, as DTensor's Shard(1)) -> the full [b, s, ...]."""
    group = _resolve_process_group(group_name)
    tp = dist.get_world_size(group)
    chunk = -(-full_len // tp)
    padded = torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, chunk - x.shape[1])) if x.shape[1] < chunk else x
    out = x.new_empty((tp * padded.shape[0], *padded.shape[1:]))  # gloo takes the ranks stacked on dim 0 only
    _all_gather_into(out, padded.contiguous(), group=group)
    return out.view(tp, *padded.shape).movedim(0, 1).reshape(x.shape[0], tp * chunk, *x.shape[2:])[:, :full_len].contiguous()


@sp_all_gather.register_fake
def _(x, group_name, full_len):
    return x.new_empty((x.shape[0], full_len, *x.shape[2:]))


class _RegionCall:
    """One forward call of one region: whether its gathered input's gradient is left partial (reduce-scattered)."""

    __slots__ = ("partial", "node")

    def __init__(self):
        self.partial = True
        self.node = None  # the gather's autograd node, until the forward check (a reference, not the tensor)


class _GatherReduceScatter(torch.autograd.Function):
    """Forward: this rank's [b, s/tp, ...] -> the full sequence. Backward: the summed partial gradient of the
    region's colwise inputs reduce-scattered onto the sequence, or (call.partial False) the replicated one sliced."""

    @staticmethod
    def forward(ctx, x, mesh, full_len, call):
        ctx.mesh, ctx.call = mesh, call
        return sp_all_gather(x, mesh.get_group().group_name, full_len)

    @staticmethod
    def backward(ctx, grad):
        source = Partial() if ctx.call.partial else Replicate()
        dt = DTensor.from_local(grad.contiguous(), ctx.mesh, [source], run_check=False)
        return dt.redistribute(ctx.mesh, [Shard(1)]).to_local(), None, None, None


class _ReplicateKeepPartial(torch.autograd.Function):
    """A colwise linear's input as a Replicate DTensor whose gradient stays this rank's partial sum (no all-reduce)
    while its region call is partial; otherwise the gradient is all-reduced as ``DTensor.from_local`` would."""

    @staticmethod
    def forward(ctx, x, mesh, call):
        ctx.mesh, ctx.call = mesh, call
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.call.partial:
            return grad.redistribute(ctx.mesh, [Replicate()]).to_local(), None, None
        if grad.placements[0].is_partial():
            return grad.to_local(), None, None
        # A replicated gradient here (not what a Shard(0) weight gives) becomes an equal share of the sum.
        return grad.to_local() / ctx.mesh.size(), None, None


class RegionColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a linear inside an SP region: fed its region's gathered tensor, its input gradient stays
    partial for the region's one reduce-scatter; fed anything else, it is torch's style."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        call = getattr(x, "_nd_sp_call", None)
        if call is not None:  # the attribute lives on that tensor object only: views and copies do not carry it
            return _ReplicateKeepPartial.apply(x, device_mesh, call)
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


def _only_colwise_uses(outputs, call: _RegionCall) -> bool:
    """Whether every autograd path from the region's outputs back to its gathered input enters it through a colwise
    linear's _ReplicateKeepPartial (a walk of the region's graph, stopped at those, at the gather and at leaves)."""
    target = call.node
    keep, gather = _ReplicateKeepPartial._backward_cls, _GatherReduceScatter._backward_cls
    flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    stack = [t.grad_fn for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or isinstance(node, keep):
            continue
        if node is target:
            return False
        seen.add(node)
        if not isinstance(node, gather):  # another region's gather: what lies before it is not this region's
            stack.extend(next_node for next_node, _ in node.next_functions)
    return True


def gather_for_region(region: nn.Module, x: torch.Tensor, mesh: DeviceMesh, full_len: int) -> torch.Tensor:
    """The region's gathered input, tagged for its colwise linears; ``region_checked`` decides its backward."""
    call = _RegionCall()
    gathered = _GatherReduceScatter.apply(x, mesh, full_len, call)
    gathered._nd_sp_call = call  # on this tensor object only: views and copies do not carry it
    call.node = gathered.grad_fn
    region._nd_sp_call = call
    return gathered


def region_checked(region: nn.Module, args, out) -> None:
    """The region's forward post-hook: keep the reduce-scatter backward only where ``_only_colwise_uses``."""
    call = region.__dict__.pop("_nd_sp_call", None)
    if call is not None:
        call.partial = _only_colwise_uses(out, call)
        call.node = None
