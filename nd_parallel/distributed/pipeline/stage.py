"""Build one pipeline stage from an HF causal LM without rewriting the model.

A stage is a *skeleton copy* of the model: the same module objects for what the stage owns, parameter-free
stand-ins for the rest (a pass-through for another stage's decoder layer, identity for another stage's
norm/head). The stage then runs the model's own ``forward`` — so attention masks, rotary embeddings,
per-layer attention types and embedding scaling are computed by transformers exactly as in one process —
and the activation received from the previous stage is injected at the input of the first layer it owns.
Parameter names stay the HF names because the skeleton keeps the model's module tree.
"""

from __future__ import annotations

import ast
import copy
import inspect
from collections import OrderedDict

import torch
import torch.nn as nn

from nd_parallel.models.hf import ModelParts, UnsplittableModel, embedding_and_head, output_arity
from nd_parallel.models.source import forward_tree

from .split import StageSpec


class PassThrough(nn.Module):
    """Stands in for a decoder layer that another stage owns: hands its hidden states on untouched, in the shape
    the real layer returns them (a bare tensor, or first of an n-tuple for families whose loop reads
    ``outputs[0]``; ``hf.output_arity``)."""

    def __init__(self, arity: int = 0, layer: nn.Module | None = None):
        super().__init__()
        self.arity = arity
        # The plain attributes the model's loop may read from a layer (NemotronH's block_type, a layer_type or
        # attention_type that picks the mask), copied from the layer it stands in for.
        plain = (str, int, float, bool, type(None))
        for name, value in (vars(layer).items() if layer is not None else ()):
            if not name.startswith("_") and name not in ("training", "arity") and isinstance(value, plain):
                setattr(self, name, value)

    def forward(self, hidden_states, *args, **kwargs):
        if self.arity:
            return (hidden_states, *([None] * (self.arity - 1)))
        return hidden_states


class ZeroStandIn(nn.Module):
    """Stands in for an input module another stage owns (e.g. GPT-2's position embedding).

    Later stages replace the first layer's input anyway; a 0-d zero keeps whatever the model adds it to
    (``inputs_embeds + wpe(position_ids)``) well-formed without knowing the module's output shape. A module fed
    activations (BLOOM's norm over the embeddings) gets zeros of their shape instead, which the model may unpack.
    """

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.is_floating_point():
            return torch.zeros_like(first, dtype=self.dtype)
        return torch.zeros((), dtype=self.dtype, device=None if first is None else first.device)


def check_stand_ins(model: nn.Module, parts: ModelParts) -> None:
    """Refuse, before any collective, a model whose decoder layers return a tuple built at run time: a stage's
    stand-in for a layer it does not own could not return the same thing, and the model's loop would read a
    wrong value or crash."""
    for layer in {type(m): m for m in model.get_submodule(parts.layers_fqn)}.values():
        if output_arity(layer) is None:
            raise UnsplittableModel(
                f"{type(layer).__name__}.forward returns a tuple whose length is decided at run time, so a pipeline "
                f"stage cannot stand in for the layers it does not own; use pp_size=1 for {type(model).__name__}")


# Decoder-layer arguments that the base model computes from the token ids, beside the hidden states (Gemma-3n/4's
# per-layer embeddings): a later stage holds neither the ids nor the modules that embed them.
_TOKEN_DERIVED_LAYER_INPUTS = ("per_layer_input", "per_layer_inputs")


def _layer_loops(tree) -> list[tuple[ast.For, set[str]]]:
    """Each ``for`` loop of a parsed forward, with the names its target binds (the layer variable)."""
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For)] if tree is not None else []
    return [(loop, {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}) for loop in loops]


def _calls_of(loop: ast.For, names: set[str]) -> list[ast.Call]:
    return [c for c in ast.walk(loop)
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in names]


def carried_layer_state(base: nn.Module) -> list[str]:
    """What ``base.forward``'s loop over its layers hands from one layer's outputs to the next layer's inputs besides
    the hidden states (HY-V4's ``prev_topk_indices=topk_indices``), read from its source."""
    carried = []
    for loop, layer in _layer_loops(forward_tree(type(base))):
        calls = {id(c) for c in _calls_of(loop, layer)}  # once per loop, not per node of it
        for node in ast.walk(loop):
            if not (isinstance(node, ast.Assign) and id(node.value) in calls
                    and isinstance(node.targets[0], ast.Tuple)):
                continue
            outs = {e.id for e in node.targets[0].elts[1:] if isinstance(e, ast.Name)}
            carried += [ast.unparse(k) for k in node.value.keywords if isinstance(k.value, ast.Name)
                        and k.value.id in outs] + [a.id for a in node.value.args[1:] if isinstance(a, ast.Name)
                                                   and a.id in outs]
    return carried


def embeddings_fed_to_layers(base: nn.Module) -> list[str]:
    """Copies of the embeddings that ``base.forward`` hands every decoder layer beside the hidden states (Zamba's
    ``original_hidden_states = torch.clone(inputs_embeds)``), read from its source."""
    tree = forward_tree(type(base))
    copies = set()
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and \
                    value.func.attr in ("clone", "detach", "contiguous"):
                value = value.args[0] if value.args else value.func.value  # torch.clone(x) or x.clone()
            if isinstance(value, ast.Name) and value.id == "inputs_embeds" and node.targets[0].id != "hidden_states":
                copies.add(node.targets[0].id)
    given = {a.id for loop, layer in _layer_loops(tree) for c in _calls_of(loop, layer)
             for a in (*c.args[1:], *(k.value for k in c.keywords)) if isinstance(a, ast.Name)}
    return sorted(copies & given)


def check_layer_inputs(model: nn.Module, parts: ModelParts) -> None:
    """Refuse, before any collective, a model whose decoder layers take a per-layer input computed from the token
    ids by modules before the layer stack, or an output of the previous layer besides the hidden states: stages
    after the first would feed their layers stand-in zeros, or nothing."""
    base_fqn = parts.layers_fqn.rpartition(".")[0]
    base = model.get_submodule(base_fqn) if base_fqn else model
    fed = embeddings_fed_to_layers(base)
    if fed:
        raise UnsplittableModel(
            f"{type(base).__name__} hands its decoder layers a copy of the embeddings ({fed[0]}) beside the hidden "
            "states; pipeline stages after the first have only the previous stage's hidden states, so it is "
            f"refused; use pp_size=1 for {type(model).__name__}")
    carried = carried_layer_state(base)
    if carried:
        raise UnsplittableModel(
            f"{type(base).__name__}'s loop over its decoder layers hands each layer's output to the next besides the "
            f"hidden states ({carried[0]}); pipeline stages pass only the hidden states between them, so it is "
            f"refused; use pp_size=1 for {type(model).__name__}")
    for layer in {type(m): m for m in model.get_submodule(parts.layers_fqn)}.values():
        params = inspect.signature(layer.forward).parameters
        taken = [name for name in _TOKEN_DERIVED_LAYER_INPUTS if name in params]
        if taken:
            raise UnsplittableModel(
                f"{type(layer).__name__}.forward takes {taken[0]}, which {type(model).__name__} computes from the "
                "token ids before its decoder layers; pipeline stages after the first have only the previous "
                "stage's hidden states, so they cannot compute it; use pp_size=1 for this model")


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing parameters/children with ``module`` but with its own containers and hooks."""
    new = copy.copy(module)
    for attr, value in vars(module).items():
        if isinstance(value, (dict, OrderedDict)) and (attr in ("_modules", "_parameters", "_buffers") or "hook" in attr):
            setattr(new, attr, type(value)(value))
    return new


def _copy_path(root: nn.Module, fqn: str) -> nn.Module:
    """Make every module on the path to ``fqn`` (exclusive) a private copy in ``root``; return the parent."""
    parent = root
    for atom in fqn.split(".")[:-1]:
        child = parent._modules[atom]
        if not getattr(child, "_nd_private", False):  # copy each module on the path once
            child = _shallow_copy(child)
            child._nd_private = True
            parent._modules[atom] = child
        parent = child
    return parent


def _replace(root: nn.Module, fqn: str, new: nn.Module) -> None:
    parent = _copy_path(root, fqn)
    parent._modules[fqn.rpartition(".")[2]] = new


def build_skeleton(model: nn.Module, parts: ModelParts, spec: StageSpec, num_stages: int) -> nn.Module:
    """The stage's copy of ``model``: owned modules shared, every other module replaced by a stand-in."""
    skeleton = _shallow_copy(model)
    owned = set(spec.layers)
    layers = _copy_path(skeleton, parts.layers_fqn + ".x")  # the ModuleList itself, privately copied
    for i in range(parts.num_layers):
        if i not in owned:
            layers._modules[str(i)] = PassThrough(output_arity(layers[i]), layers[i])
    if spec.index != 0:
        dtype = next(model.parameters()).dtype
        for fqn in parts.pre:
            _replace(skeleton, fqn, ZeroStandIn(dtype))
    if spec.index != num_stages - 1:
        for fqn in parts.post:
            _replace(skeleton, fqn, nn.Identity())
    return skeleton


class StageRunner:
    """The forward of one stage, installed on its skeleton: model forward + activation injection."""

    def __init__(self, skeleton: nn.Module, parts: ModelParts, spec: StageSpec, num_stages: int,
                 embed_dim: int | None = None):
        self.is_first = spec.index == 0
        self.embed_dim = embed_dim  # the width of inputs_embeds, which the activation between layers may not have
        self.is_last = spec.index == num_stages - 1
        self.causal_lm_forward = type(skeleton).forward.__get__(skeleton)
        base_fqn = parts.layers_fqn.rpartition(".")[0]
        self.base = skeleton.get_submodule(base_fqn) if base_fqn else skeleton
        self.injected: torch.Tensor | None = None
        self.loss = None  # the pipeline's PipelineLoss on the last stage when its loss is chunked
        if not self.is_first and spec.layers:
            first = skeleton.get_submodule(f"{parts.layers_fqn}.{spec.layers[0]}")
            first.register_forward_pre_hook(self._inject, with_kwargs=True)
        elif not self.is_first:
            # A last stage with no layer: the activation goes straight to the final norm / head.
            first = skeleton.get_submodule(parts.post[0])
            first.register_forward_pre_hook(self._inject, with_kwargs=True)

    def _inject(self, module, args, kwargs):
        if self.injected is None:
            return None
        hidden, self.injected = self.injected, None
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def __call__(self, x: torch.Tensor, attention_mask=None, position_ids=None, **extra) -> torch.Tensor:
        # extra: per-row tensors the attention needs besides the mask (context parallelism's key metadata)
        common = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **extra)
        if self.is_first:
            inputs = dict(input_ids=x)
        else:
            if self.loss is not None and self.loss.metadata_call:
                x = _not_garbage(x)
            # transformers needs *some* input to derive shapes, masks and positions; the real activation
            # replaces these zeros at the first owned layer (after any embedding scaling, which zeros ignore).
            self.injected = x
            inputs = dict(inputs_embeds=self._zero_embeddings(x))
        if self.is_last and self.loss is not None and self.loss.chunks():
            _, hidden = self.loss.head.run(**inputs, **common)
            if self.loss.head.enabled:  # the loss runs the head chunk by chunk (chunked_loss.py)
                return hidden
        if self.is_last:
            return self.causal_lm_forward(**inputs, **common).logits
        return self.base(**inputs, **common).last_hidden_state

    def _zero_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """Zeros in the shape of the embeddings, [batch, seq, embed_dim]. Between layers most families pass that
        shape on, but some widen it (DeepSeek-V4's hyper-connections pass [batch, seq, streams, hidden] and expand
        the embeddings into it themselves)."""
        if self.embed_dim is None or (x.dim() == 3 and x.shape[-1] == self.embed_dim):
            return torch.zeros_like(x)
        return x.new_zeros(x.shape[0], x.shape[1], self.embed_dim)


def _not_garbage(x: torch.Tensor) -> torch.Tensor:
    """Fixed normal values in place of the activation torch's metadata inference hands a stage: a torch.empty buffer
    (pipeline/torch_backend.py). The chunked loss checks its head once, on its first call, which is that one: on
    zeros a soft-capped head looks linear, and on NaN the check failed, so the path the loss took depended on what
    the allocator held (an evaluation before training changed it: 1 ulp under cp2_pp2). The same values on every
    rank and in every run: the same decision. Selected by ``where``, not written in place or detached: torch
    infers the input gradient's metadata through this tensor (x may be FSDP's view of it: no in-place write)."""
    if not x.is_floating_point():
        return x
    g = torch.Generator(device=x.device).manual_seed(0)
    fixed = torch.randn(x.shape, generator=g, dtype=x.dtype, device=x.device)
    return torch.where(torch.ones((), dtype=torch.bool, device=x.device), fixed, x)


def make_stage_module(model: nn.Module, parts: ModelParts, spec: StageSpec, num_stages: int) -> nn.Module:
    embed_dim = getattr(embedding_and_head(model)[0], "embedding_dim", None)
    skeleton = build_skeleton(model, parts, spec, num_stages)
    runner = StageRunner(skeleton, parts, spec, num_stages, embed_dim if isinstance(embed_dim, int) else None)
    skeleton.forward = runner  # instance attribute: nn.Module.__call__ runs it, hooks (FSDP's too) still fire
    skeleton._nd_stage_runner = runner
    return skeleton
