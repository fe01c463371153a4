"""Megatron-style sequence parallelism between the tensor-parallel regions (``sequence_parallel=True | "auto"``).

Under plain TP every rank holds the whole sequence between the TP regions: the residual stream, the norms and
their saved inputs are replicated tp times. With sequence parallelism the decoder layers keep that stream split
on the sequence dim (``Shard(1)``) across the tp ranks, so those activations are ÷ tp:

- a **TP region** is a child of a decoder layer that holds modules the plan splits (attention, MLP, a state-space
  mixer). Its hidden-states input is all-gathered on the sequence before its colwise linears (a pre-hook on the
  region), and its rowwise linears reduce-scatter their output onto the sequence (``RowwiseParallel(
  output_layouts=Shard(1))`` instead of the all-reduce);
- every other child of a layer (the norms: pre-norms, post-norms, sandwich norms; dropout) runs on this rank's
  tokens. Children with parameters get torch's ``SequenceParallel`` style: their weights become Replicate
  DTensors, so each weight's gradient, a partial sum over this rank's tokens, is all-reduced over tp;
- the **entry** of a model part is its first decoder layer's input: the replicated hidden states are sliced onto
  the sequence there (no communication forward; an all-gather of the gradient backward). The embedding's output
  stays replicated because a Hugging Face base model derives ``cache_position``, the position ids, the rotary
  tables and the causal mask from ``inputs_embeds.shape`` before the first layer: a sequence-sharded embedding
  output would give each rank the positions 0..s/tp. So rotary and masks always see the full positions, and the
  attention regions receive them whole, with the gathered sequence;
- the **exit** (``gather_before_head``) all-gathers the stream back after the final norm (after the last layer of a
  pipeline stage that has none), so the head, the chunked loss, evaluation logits and pipeline sends see exactly
  what they see without SP. A vocabulary-parallel head would take its ``Shard(1)`` input from that same place.

What stays inside the regions: per-head q/k norms (``replicated_with_grad_allreduce`` in the plan) run on the
gathered sequence and this rank's heads, as without SP; a norm fused into a region's first module runs on the
gathered sequence (correct, not ÷ tp). Where a model does not fit this shape, ``sequence_plan`` returns the reason
and "auto" keeps SP off (one log line), while an explicit ``True`` is refused before any collective: plans with
MoE / packed / local-parameter styles inside the layers (the experts' outputs are all-reduced by their own styles),
parameters directly on a layer or weights (not 1-D norm parameters) in a child no plan entry splits, PEFT adapters
on split modules, and post-layer modules other than norms.

Communication (Megatron's): forward one all-gather per region input and a reduce-scatter per rowwise output
(instead of its all-reduce); backward an all-gather per rowwise output's gradient and **one reduce-scatter per
region input**: the region's colwise linears (``RegionColwiseParallel``) leave their input gradients partial sums
over tp, summed locally, and the gather's backward reduce-scatters the sum onto the sequence. Per layer of a Llama
(two regions, 5 colwise and 2 rowwise linears) with B = b·s·h·bytes, a ring moving (tp-1)/tp of its buffer per
all-gather / reduce-scatter and twice that per all-reduce: plain TP moves 2·(tp-1)/tp·B per all-reduce, 2 forward
+ 5 backward = 14·(tp-1)/tp·B; SP 4 forward + 4 backward = 8·(tp-1)/tp·B (before the reduce-scatter backward it
was 16: each colwise input's all-reduce, then a slice). That is exact only when every gradient reaching the
gathered tensor is such a partial sum. The region's forward post-hook checks it on the autograd graph, every
call, before any backward: a use of the gathered input by anything but a colwise linear fed that very tensor (a
norm or a residual inside the region, a reshape or copy before a linear) gives a replicated gradient, which the
sum would count tp times; that call then takes the old path (each colwise input gradient all-reduced, the
gather's backward slicing). Compiled layers (``compile=True``) take the old path too: dynamo cannot trace the
graph check. tests/distributed/test_sp_comm.py counts both paths' collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from nd_parallel.models import hf

from .sequence_parallel_comm import RegionColwiseParallel, gather_for_region, region_checked

__all__ = ["RegionColwiseParallel", "SequencePlan", "apply_sequence_parallel", "applied", "sequence_plan"]

logger = logging.getLogger(__name__)

# Styles a plan may give modules inside a decoder layer for SP to be exact: the region's linears and the per-head
# norms inside it. Other styles (moe_tp_experts, packed_colwise, local_params, all_reduce, ...) produce outputs
# whose reduction is their own; SP stays off there.
REGION_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


@dataclass
class SequencePlan:
    """Where the sequence is split, gathered and reduce-scattered in one model part (HF module names)."""

    layers: list[str]
    regions: list[str] = field(default_factory=list)
    """Children of layers that hold split modules: their hidden-states input is gathered."""
    norms: list[str] = field(default_factory=list)
    """Modules with parameters that run on this rank's tokens (SequenceParallel: grads all-reduced over tp)."""
    rowwise: list[str] = field(default_factory=list)
    """Rowwise linears inside layers: output reduce-scattered onto the sequence."""
    colwise: list[str] = field(default_factory=list)
    """Colwise linears inside the regions: fed the gathered input, they leave its gradient a partial sum."""
    exit: str = ""
    """The module after which the stream is gathered back (the final norm, else the part's last layer)."""


def _holds_split(fqn: str, matched: dict[str, str]) -> list[str]:
    return [n for n in matched if n == fqn or n.startswith(fqn + ".")]


def _layer_plan(part: nn.Module, fqn: str, matched: dict[str, str], plan: SequencePlan) -> str | None:
    """Add one decoder layer's regions, norms and rowwise linears to ``plan``; the reason SP is not exact, or None."""
    layer = part.get_submodule(fqn)
    own = [n for n, _ in layer.named_parameters(recurse=False)]
    if own:
        return (f"{type(layer).__name__} holds parameters of its own ({', '.join(own)}) used on the residual "
                "stream outside any module")
    for name, child in layer.named_children():
        child_fqn = f"{fqn}.{name}"
        inside = _holds_split(child_fqn, matched)
        if inside:
            odd = [f"{n}: {matched[n]!r}" for n in inside if matched[n] not in REGION_STYLES]
            if odd:
                return (f"the TP plan gives {odd[0]} inside {type(layer).__name__} (expert / packed / local styles "
                        f"reduce their own outputs; SP covers {', '.join(REGION_STYLES)})")
            adapted = [n for n in inside if ".base_layer" in n or ".lora_" in n]
            if adapted:
                return f"a PEFT adapter sits on the split module {adapted[0]}"
            rowwise = [n for n in inside if matched[n] == "rowwise"]
            if not rowwise:
                return f"the TP region {child_fqn} has no rowwise linear, so its output is not a partial sum"
            plan.regions.append(child_fqn)
            plan.rowwise += rowwise
            plan.colwise += [n for n in inside if matched[n] == "colwise"]
            continue
        weights = [n for n, p in child.named_parameters() if p.ndim != 1]
        if weights:
            return (f"{child_fqn} ({type(child).__name__}) holds weights ({weights[0]}) that no plan entry splits, "
                    "outside the TP regions")
        if next(child.parameters(), None) is not None:
            plan.norms.append(child_fqn)
    return None


def _post_norms(part: nn.Module, stack_fqn: str) -> tuple[list[str], str | None]:
    """The modules with parameters the base model runs after its layers (the final norm), in order."""
    parent_fqn, _, stack_name = stack_fqn.rpartition(".")
    parent = part.get_submodule(parent_fqn) if parent_fqn else part
    prefix = f"{parent_fqn}." if parent_fqn else ""
    owned = [n for n, c in parent.named_children() if n == stack_name or next(c.parameters(), None) is not None]
    order = hf.forward_order(parent, owned)
    if order is None:
        return [], f"the forward of {type(parent).__name__} could not be read to find what runs after its layers"
    post = sorted((n for n in owned if order[n] > order[stack_name]), key=order.get)
    for name in post:
        weights = [n for n, p in parent.get_submodule(name).named_parameters() if p.ndim != 1]
        if weights:
            return [], (f"{prefix}{name} runs after the layers and holds weights ({weights[0]}); SP ends at a final "
                        "norm")
    return [prefix + n for n in post], None


def sequence_plan(part: nn.Module, matched: dict[str, str]) -> SequencePlan | str:
    """The sequence-parallel plan of ``part`` (a model or a pipeline stage) under the concrete TP plan ``matched``
    (module name -> style), derived from its structure; or the reason it would not be exact."""
    found = hf.find_layer_stack(part)
    if found is None:
        return f"{type(part).__name__} has no decoder-layer stack"
    stack_fqn, stack = found
    layers = [f"{stack_fqn}.{i}" for i, layer in enumerate(stack) if next(layer.parameters(), None) is not None]
    if not layers:
        return f"{type(part).__name__} holds no decoder layer here"
    plan = SequencePlan(layers=layers)
    for fqn in layers:
        reason = _layer_plan(part, fqn, matched, plan)
        if reason is not None:
            return reason
    post, reason = _post_norms(part, stack_fqn)
    if reason is not None:
        return reason
    if post:
        plan.norms += post
        plan.exit = post[-1]
    else:
        if hf.output_arity(part.get_submodule(layers[-1])) is None:
            return f"{type(part.get_submodule(layers[-1])).__name__} returns a tuple built at run time"
        plan.exit = layers[-1]
    return plan


def reason_not_exact(model: nn.Module, matched: dict[str, str]) -> str | None:
    """Why SP would not be exact for ``model`` under ``matched``; None where it is."""
    found = sequence_plan(model, matched)
    return found if isinstance(found, str) else None


# ------------------------------------------------------------------------------------------- the runtime
class _Sequence:
    """The full (per-part) sequence length of the running forward, recorded at the entry: a rank's shard cannot
    tell it (torch.chunk gives 12 tokens of 23 and of 24 alike), and the gathers need the global shape."""

    full_len: int = 0


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def split_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Replicated [b, s, ...] -> this rank's [b, s/tp, ...] (torch.chunk sizes); backward all-gathers the grad."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh, full_len: int) -> torch.Tensor:
    """This rank's [b, s/tp, ...] -> the full [b, s, ...] on every rank; backward slices the (replicated) grad."""
    shape = (x.shape[0], full_len, *x.shape[2:])
    dt = DTensor.from_local(x, mesh, [Shard(1)], run_check=False, shape=torch.Size(shape),
                            stride=_contiguous_stride(shape))
    return dt.redistribute(mesh, [Replicate()]).to_local()


def _map_hidden(module: nn.Module, args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    """Apply ``fn`` to the hidden states a layer or region is called with: its first positional tensor, else the
    ``hidden_states`` keyword (transformers' convention for both)."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise RuntimeError(f"sequence parallelism: {type(module).__name__} was called without hidden states as its "
                       "first argument or as hidden_states=; use ParallelismConfig(sequence_parallel=False)")


def _map_output(out, fn):
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (fn(out[0]), *out[1:])
    return out


def apply_sequence_parallel(part: nn.Module, tp_mesh: DeviceMesh, plan: SequencePlan) -> None:
    """Install ``plan`` on ``part``, whose TP plan (with ``plan.rowwise`` as ``Shard(1)`` outputs) is applied."""
    seq = _Sequence()

    def entry(module, args, kwargs):
        def split(x):
            seq.full_len = x.shape[1]
            return split_sequence(x, tp_mesh)
        return _map_hidden(module, args, kwargs, split)

    def region(module, args, kwargs):
        def gather(x):
            # Compiled (dynamo cannot trace the graph check) or not training: the gather whose backward slices.
            if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and x.requires_grad):
                return gather_sequence(x, tp_mesh, seq.full_len)
            return gather_for_region(module, x, tp_mesh, seq.full_len)
        return _map_hidden(module, args, kwargs, gather)

    # The entry runs after the hooks already there: a pipeline stage injects the received activation at its first
    # layer's input (pipeline/stage.py), which is what must be split. A region's gather must run before a colwise
    # style's own input hook on the same module (a region that is a single Linear): prepend.
    part.get_submodule(plan.layers[0]).register_forward_pre_hook(entry, with_kwargs=True)
    for name in plan.regions:
        part.get_submodule(name).register_forward_pre_hook(region, with_kwargs=True, prepend=True)
        part.get_submodule(name).register_forward_hook(region_checked, prepend=True)
    parallelize_module(part, tp_mesh, {name: SequenceParallel(use_local_output=True) for name in plan.norms})
    gather_before_head(part.get_submodule(plan.exit), tp_mesh, seq)
    part._nd_parallel_sequence_parallel = plan  # what was applied, for tests and reports
    logger.info("applied sequence parallelism over %d ranks: %d regions, %d norms, gathered after %s",
                tp_mesh.size(), len(plan.regions), len(plan.norms), plan.exit)


def applied(model: nn.Module) -> bool:
    """Whether sequence parallelism runs in ``model`` (a model, a PeftModel or a pipeline's stages)."""
    return any(hasattr(m, "_nd_parallel_sequence_parallel") for m in model.modules())


def gather_before_head(module: nn.Module, tp_mesh: DeviceMesh, seq: _Sequence) -> None:
    """THE place where the sequence-split stream becomes whole again: after the final norm (or a stage's last
    layer), so the head, the chunked loss, logits and pipeline sends see the replicated hidden states, as without
    SP. Registered after ``SequenceParallel``'s own output hook, so it receives the local shard."""
    module.register_forward_hook(lambda mod, args, out: _map_output(out, lambda x: gather_sequence(
        x, tp_mesh, seq.full_len)))
