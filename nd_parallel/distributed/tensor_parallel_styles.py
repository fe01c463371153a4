"""The TP styles of transformers' plans that torch's ``ParallelStyle`` classes do not cover.

Mixture-of-experts and MLA models (transformers 5.24: 63 of 195 causal-LM types) declare styles beyond
colwise/rowwise: stacked expert weights ``[num_experts, out, in]`` split inside a ``moe_tp_experts`` module,
packed (fused gate|up) weights split so each rank keeps its slice of *both* halves, MLA's ``kv_a_proj`` whose rope
part skips the column-wise ``kv_b_proj``, bare parameters (attention sinks) used by a ``local_params`` forward, and
a few output-only styles. Each keeps transformers' meaning (``transformers/distributed/tensor_parallel.py``).

Why written here and not taken from there: transformers' style classes replace ``module.forward`` with a closure
its loading path also detects and undoes (``transformers_tp.py``), their API moved between 5.16 and 5.24, and
they shard parameters on the meta device during loading. torch has no style for a 3-D expert weight, a packed
weight, or a module whose forward must see local shards. So these are small torch ``ParallelStyle`` subclasses
(applied by ``parallelize_module`` with the rest of the plan) built from DTensor primitives only: parameters are
``distribute_tensor``-ed with ``Shard`` / ``_StridedShard`` placements (so FSDP2, DCP, ``full_tensor`` and the
global grad norm treat them like any TP parameter) and the collectives are DTensor redistributions.

Parameter entries (a plan key naming a parameter, e.g. ``layers.*.mlp.experts.gate_up_proj``) only place the
parameter; the module that owns it must run its forward on local shards (``moe_tp_experts`` or
``local_params``), which ``check_param_entries`` verifies before any collective.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

# Modules whose forward runs on their parameters' local shards; a parameter entry must sit under one of them.
LOCAL_FORWARD = ("moe_tp_experts", "local_params")
# Styles a plan may give a parameter (transformers' ``shard_param`` of each style).
PARAM_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise", "replicate")


def all_reduce_backward(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the gradient is summed over ``mesh``. For a replicated input a rank uses with only its
    shard of the weights: its gradient there is a partial sum. (torch's ColwiseParallel does the same with its
    input; ``from_local(Replicate)`` redistributes a Partial gradient to Replicate.)"""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def all_reduce_forward(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum the ranks' partial outputs; the gradient passes through unchanged (Partial forward -> Replicate grad)."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def param_placement(style: str, name: str, ndim: int):
    """transformers' placement of one parameter under ``style``; None keeps it replicated (a plain tensor).
    ``name``: the parameter's own name (``bias`` stays whole under rowwise: it is added after the reduction)."""
    if style == "replicate":
        return None
    if style == "colwise":  # output features: dim 0 of a Linear weight, dim 1 of a stacked [E, out, in] expert weight
        return Shard(max(ndim - 2, 0))
    if style == "rowwise":
        return None if name == "bias" or ndim == 1 else Shard(ndim - 1)
    if style == "packed_colwise":  # [gate | up] along the output dim: each rank keeps its slice of both halves
        return _StridedShard(max(ndim - 2, 0), split_factor=2)
    if style == "packed_rowwise":  # packed along the last dim ([E, in, 2*out] experts, llama4)
        return None if ndim == 1 else _StridedShard(ndim - 1, split_factor=2)
    raise ValueError(f"style {style!r} cannot place a parameter; parameter styles: {PARAM_STYLES}")


def shard_dim_size(style: str, name: str, shape: torch.Size) -> tuple[int, int] | None:
    """(dim, divisor per rank) that ``style`` splits, for the divisibility check; None when nothing is split."""
    placement = param_placement(style, name, len(shape))
    if placement is None:
        return None
    return placement.dim, (2 if isinstance(placement, _StridedShard) else 1)


def shard_param(module: nn.Module, name: str, style: str, mesh: DeviceMesh) -> None:
    """Replace ``module.<name>`` by its DTensor under ``style`` (every rank holds the same full weight, so each
    keeps its slice without a broadcast)."""
    param = module._parameters[name]
    placement = param_placement(style, name, param.ndim)
    if placement is None or isinstance(param, DTensor):
        return
    dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
    module._parameters[name] = nn.Parameter(dt, requires_grad=param.requires_grad)


class _LocalParams:
    """The module's own DTensor parameters swapped for their local shards while its forward runs. ``to_local`` is
    differentiable, so the shard's gradient lands on the DTensor parameter (as transformers' local-tensor path)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __enter__(self):
        self.saved = {n: p for n, p in self.module._parameters.items() if isinstance(p, DTensor)}
        for n, p in self.saved.items():
            self.module._parameters[n] = p.to_local()

    def __exit__(self, *exc):
        self.module._parameters.update(self.saved)


def _wrap_forward(module: nn.Module, before=None, after=None, local: bool = False) -> nn.Module:
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if before is not None:
            args, kwargs = before(args, kwargs)
        if local:
            with _LocalParams(module):
                out = original(*args, **kwargs)
        else:
            out = original(*args, **kwargs)
        return after(out) if after is not None and out is not None else out

    module.forward = forward
    return module


def _float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class MoeExperts(ParallelStyle):
    """``moe_tp_experts``: every rank runs every expert on its shard of the expert weights (placed by the plan's
    parameter entries: gate_up by output features, down by input features). The inputs are whole on every rank
    (hidden states and routing weights, computed by the replicated router), so their gradients are partial sums
    over TP and are all-reduced; that also gives the router its full gradient. The partial outputs are summed."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def before(args, kwargs):
            args = tuple(all_reduce_backward(a, mesh) if _float(a) else a for a in args)
            kwargs = {k: all_reduce_backward(v, mesh) if _float(v) else v for k, v in kwargs.items()}
            return args, kwargs

        return _wrap_forward(module, before, lambda out: all_reduce_forward(out, mesh), local=True)


class LocalParams(ParallelStyle):
    """``local_params``: the module's forward sees its own sharded parameters (e.g. attention sinks, split by
    heads by their own parameter entry) as local shards; its submodules keep their own styles."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return _wrap_forward(module, local=True)


class PackedColwiseModule(ParallelStyle):
    """``packed_colwise`` on a module (a fused gate|up Linear): its weight and bias split as packed, the replicated
    input's gradient all-reduced, the output this rank's slice of both halves (the model splits it in two)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name in list(module._parameters):
            if module._parameters[name] is not None:
                shard_param(module, name, "packed_colwise", mesh)

        def before(args, kwargs):
            return (all_reduce_backward(args[0], mesh), *args[1:]), kwargs

        return _wrap_forward(module, before, local=True)


class MlaKvAProj(ParallelStyle):
    """``mla_kv_a_proj``: the output's last ``qk_rope_head_dim`` features (the shared rope key) go straight into
    attention over this rank's heads, bypassing the column-wise ``kv_b_proj`` whose input gradient is already
    all-reduced, so their gradient is partial and is all-reduced here."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def after(out):
            kv, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            return torch.cat([kv, all_reduce_backward(rope, mesh)], dim=-1)

        return _wrap_forward(module, after=after)


class AllReduceOutput(ParallelStyle):
    """``all_reduce``: the module's output is a partial sum over TP (e.g. shared experts whose own entries split
    them); sum it."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return _wrap_forward(module, after=lambda out: all_reduce_forward(out, mesh))


class IdentityExpert(ParallelStyle):
    """``moe_identity_expert``: a parameter-free expert inside ``moe_tp_experts`` returns its input on every rank,
    which the experts' output all-reduce would count tp times; its input is divided by tp first."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        size = mesh.size()
        return _wrap_forward(module, lambda args, kwargs: ((args[0] / size, *args[1:]), kwargs))


class Replicated(ParallelStyle):
    """``replicate``: every rank keeps the whole module (a plain tensor, as without a plan entry)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return module


def clone_outputs_modified_in_place(model: nn.Module, names) -> int:
    """Clone the output of each module whose parent's forward modifies it in place (llama4's
    ``out = self.shared_expert(x); out.add_(...)``) where that module is, or holds, one TP styled (``names``): a
    rowwise output is the view ``to_local`` returns, and autograd refuses an in-place change of a custom Function's
    view output. One copy of that output, only where needed."""
    from nd_parallel.models.hf import outputs_modified_in_place

    styled = list(names)
    cloned = 0
    for parent_name, parent in model.named_modules():
        for child in outputs_modified_in_place(parent):
            name = f"{parent_name}.{child}" if parent_name else child
            if any(n == name or n.startswith(name + ".") for n in styled):
                getattr(parent, child).register_forward_hook(
                    lambda _m, _a, out: out.clone() if isinstance(out, torch.Tensor) else out)
                cloned += 1
    return cloned


# Styles whose module's output is split over tp (the region opens) and whose input is (the region closes).
_OPENS, _CLOSES = ("colwise", "packed_colwise"), ("rowwise",)


def region_scalars(model: nn.Module, matched: dict[str, str]) -> dict[str, str]:
    """Modules the plan does not name that hold only scalar parameters and sit beside a module opening a TP region
    and one closing it (a learnable activation such as Apertus' xIELU between up_proj and down_proj): each rank
    applies them to its shard of the features, so their gradient is a partial sum; the style made for per-head
    norms (replicated weights, gradient all-reduced over tp) makes it whole. transformers' plans omit them."""
    children: dict[str, set] = {}
    for name, style in matched.items():
        parent = name.rpartition(".")[0]
        children.setdefault(parent, set()).add(style)
    found = {}
    for parent, styles in children.items():
        if not (styles & set(_OPENS) and styles & set(_CLOSES)):
            continue
        for child, module in (model.get_submodule(parent) if parent else model).named_children():
            name = f"{parent}.{child}" if parent else child
            params = list(module.parameters())
            if name not in matched and params and all(p.numel() == 1 for p in params):
                found[name] = "replicated_with_grad_allreduce"
    return found


def check_own_masks(model: nn.Module, matched: dict[str, str], tp_size: int) -> None:
    """Refuse, before any collective, an attention module that computes its own mask from its projections while
    the plan splits them (Doge's dynamic mask from the values): the mask is built per head, and nothing in the
    plan gives it only this rank's heads, so the attention would get another head count than its queries."""
    from nd_parallel.models.attention_calls import computed_attention_masks

    for name, module in model.named_modules():
        masks = computed_attention_masks(type(module))
        if not masks:
            continue
        split = [k for k in matched if k.startswith(name + ".")]
        if split:
            raise NotImplementedError(
                f"{name} ({type(module).__name__}) computes its own attention mask ({masks[0]}) from projections the "
                f"tp_plan splits ({split[0]}: {matched[split[0]]}); with tp_size={tp_size} that mask would not hold "
                f"only this rank's heads; use tp_size=1 for {type(model).__name__}, or a tp_plan that leaves "
                f"{name}.* unsplit")


def per_head_norms(model: nn.Module, matched: dict[str, str]) -> dict[str, str]:
    """Per-head norms a model's plan leaves out (SarvamMoE's q_norm / k_norm, where Qwen3's plan names its own):
    a one-input module beside "colwise" projections (their output stays split over the heads) whose only
    parameter is a ``[head_dim]`` weight normalises this rank's heads, so its gradient is a partial sum over tp;
    it gets Qwen3's style, which all-reduces it."""
    from nd_parallel.models.hf import text_config

    text = text_config(model)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    # "colwise" leaves its output split over the heads (colwise_rep / _gather_output replicate it).
    colwise: dict[str, set[str]] = {}
    for key, style in matched.items():
        if style == "colwise":
            parent, _, child = key.rpartition(".")
            colwise.setdefault(parent, set()).add(child)
    found = {}
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        weights = [p for _, p in module.named_parameters(recurse=False)]
        split = colwise.get(parent)
        if name not in matched and split and len(weights) == 1 and weights[0].shape == (head_dim,) and \
                len(inspect.signature(module.forward).parameters) == 1 and \
                _fed_by(type(model.get_submodule(parent)), name.rpartition(".")[2], split):
            found[name] = "replicated_with_grad_allreduce"
    return found


def _fed_by(parent: type, child: str, producers: set[str]) -> bool:
    """Whether ``parent.forward`` calls ``self.<child>`` on the output of one of ``self.<producers>`` (directly,
    or through the variables it assigns), read from its source."""
    import ast

    from nd_parallel.models.source import forward_tree

    tree = forward_tree(parent)
    if tree is None:
        return False

    def uses(node) -> set[str]:  # self.<attr> and variable names an expression reads
        return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.value.id == "self"} | {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    reads: dict[str, set[str]] = {}
    for _ in range(3):  # variables of variables: a few assignments deep
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.Assign)):
            for target in (t for t in node.targets if isinstance(t, ast.Name)):
                read = uses(node.value)
                deeper = set().union(*(reads.get(v, set()) for v in read))
                reads[target.id] = reads.get(target.id, set()) | read | deeper
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
        if call.func.attr == child and isinstance(call.func.value, ast.Name) and call.func.value.id == "self":
            read = set().union(*(uses(a) for a in call.args))
            if (read | set().union(*(reads.get(v, set()) for v in read))) & producers:
                return True
    return False
