"""The one place that knows the structure of a Hugging Face causal LM.

Every other module asks here: which config is the text config, which ModuleList holds the decoder layers (and so
which modules are the layers FSDP shards and checkpointing wraps, and which the pipeline cuts), which modules come
before and after that stack, where the embedding and the head are and whether they share a weight, and the
model's own tensor- and pipeline-parallel plans. Answers come from the model's own metadata (its ``pp_plan``,
``_no_split_modules``, ``get_input_embeddings`` / ``get_output_embeddings``, ``base_model_tp_plan``), never from a
list of family names, so a new family is understood the same way.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

import torch.nn as nn

from .attention_calls import attention_keywords
from .source import forward_tree


class UnsplittableModel(ValueError):
    """The model has no structure we can cut into stages; the message says why."""


# ------------------------------------------------------------------------------------------------ config
def text_config(model_or_config):
    """The config of the language model: the config itself for a text-only model, its text part for a
    multimodal one (``get_text_config``); accepts a model or a config."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vocab_size(model_or_config) -> int:
    return text_config(model_or_config).vocab_size


# ------------------------------------------------------------------------------------------ layer stack
def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _plan_layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The decoder-layer ModuleList named by the model's own pp_plan (transformers' ``base_model_pp_plan``)."""
    plan = getattr(model, "pp_plan", None) or {}
    if not plan:
        base = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}
    modules = dict(model.named_modules())
    stacks = [(k, modules[k]) for k in plan if isinstance(modules.get(k), nn.ModuleList) and len(modules[k]) > 0]
    return stacks[0] if len(stacks) == 1 else None


def find_layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(name, ModuleList) of the decoder layers, or None.

    In order: the ModuleList the model's pp_plan names; else the ModuleList made of the block class the model
    names in ``_no_split_modules`` (a list of MoE experts can be longer than the layer stack); else the longest
    ModuleList.
    """
    from_plan = _plan_layer_stack(model)
    if from_plan is not None:
        return from_plan
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return None
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    of_blocks = [(n, m) for n, m in lists if any(type(c).__name__ in blocks for c in m)]
    return max(of_blocks or lists, key=lambda item: len(item[1]))


def layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``find_layer_stack``, or UnsplittableModel naming the model."""
    found = find_layer_stack(model)
    if found is None:
        raise UnsplittableModel(
            f"{type(model).__name__} has no ModuleList of decoder layers, so it cannot be cut into pipeline "
            "stages; use pp_size=1")
    return found


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers ``model`` holds: the members of its layer stack that have parameters (a pipeline stage
    keeps parameter-free stand-ins for the layers other stages own). FSDP shards and checkpointing wraps these."""
    found = find_layer_stack(model)
    if found is None:
        return []
    return [layer for layer in found[1] if _has_params(layer)]


@dataclass(frozen=True)
class ModelParts:
    """Fully-qualified module names of a causal LM, in execution order."""

    pre: tuple[str, ...]  # embeddings etc.: first stage
    layers_fqn: str  # the ModuleList of decoder layers, e.g. "model.layers"
    num_layers: int
    post: tuple[str, ...]  # final norm, lm_head: last stage
    shared: tuple[str, ...] = ()  # parameter-free helpers every stage runs (rotary embeddings)


def model_parts(model: nn.Module) -> ModelParts:
    """Describe ``model`` as pre / layers / post modules (HF names), from its layer stack and module tree.

    Around the stack the base model's forward decides (a plan's dict order is not execution order, nor is the
    order modules were registered in): modules it uses before the stack come first, modules after it and the
    outer model's heads last (registration order where its source cannot be read), and modules without
    parameters (rotary embeddings, dropout) are shared by every stage.
    """
    layers_fqn, layers = layer_stack(model)
    parent_fqn, _, _ = layers_fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    prefix = f"{parent_fqn}." if parent_fqn else ""
    pre, post, shared = [], [], []
    children = [name for name, child in parent.named_children() if _has_params(child)]
    order = forward_order(parent, children) or {name: i for i, name in enumerate(children)}
    stack = order[layers_fqn.rpartition(".")[2]]
    # A parameter-free module the forward runs after the stack (OLMo's final LayerNorm has no weights) belongs to
    # the last stage like any final norm: run by every stage it would be applied to the activations stages pass on.
    uses = _uses(parent, [name for name, _ in parent.named_children()])
    at_stack = uses.get(layers_fqn.rpartition(".")[2], [(0, 0)])[0]
    after_stack = {n for n, at in uses.items() if at[0] > at_stack}
    both = [n for n, at in uses.items() if at[0] < at_stack < at[-1] and not _has_params(getattr(parent, n))]
    if both:  # one module, two roles: no stage split can keep the first use and drop the second
        raise UnsplittableModel(
            f"{type(model).__name__}'s forward uses {prefix}{both[0]} both before and after {layers_fqn}, so it "
            "cannot be given to one pipeline stage; use pp_size=1 for this model")
    for name, child in parent.named_children():
        fqn = prefix + name
        if fqn == layers_fqn:
            continue
        if not _has_params(child):
            (post if name in after_stack else shared).append(fqn)
        else:
            (post if order[name] > stack else pre).append(fqn)
    # Modules of the outer model beside the base model (lm_head, or a score head) come last.
    for name, child in model.named_children():
        if not (parent_fqn == name or parent_fqn.startswith(name + ".")) and _has_params(child):
            post.append(name)
    if not pre or "inputs_embeds" not in inspect.signature(parent.forward).parameters:
        # (RemBERT's encoder holds an input projection but takes hidden_states: the embeddings are outside it.)
        raise UnsplittableModel(
            f"{type(model).__name__}: found no embedding before {layers_fqn} in {type(parent).__name__}, whose "
            "forward the stages run; nd_parallel splits decoder-only causal LMs (embeddings -> layers -> norm -> "
            "head); use pp_size=1 for this model")
    return ModelParts(tuple(pre), layers_fqn, len(layers), tuple(post), tuple(shared))


# --------------------------------------------------------------------------------- embeddings and head
def embedding_and_head(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    return _slot(model, "get_input_embeddings"), _slot(model, "get_output_embeddings")


def _slot(model: nn.Module, getter: str) -> nn.Module | None:
    # On a pipeline stage the getter may reach into a stand-in (ModernBERT-decoder's embeddings.tok_embeddings).
    try:
        return getattr(model, getter)() if hasattr(model, getter) else None
    except AttributeError:
        return None


def shares_embedding(model: nn.Module) -> bool:
    """Whether the head's weight *is* the embedding's weight in this module (object identity)."""
    emb, head = embedding_and_head(model)
    return head is not None and emb is not None and getattr(head, "weight", None) is getattr(emb, "weight", 1)


def ties_embeddings(model_or_config) -> bool:
    """Whether the config ties the head to the embedding: true for a pipeline stage that holds only one of them."""
    return bool(getattr(text_config(model_or_config), "tie_word_embeddings", False))


def slot_name(model: nn.Module, getter: str) -> str | None:
    """Module name of the input-embedding / output-head slot (``get_input_embeddings`` / ``get_output_embeddings``);
    a pipeline stage may hold a stand-in there."""
    module = _slot(model, getter)
    if module is None:
        return None
    return next((n for n, m in model.named_modules() if m is module), None)


# ------------------------------------------------------------------------------------------------ plans
def _from_base_plan(model: nn.Module, base: dict) -> dict:
    """A base-model plan's keys under the top-level model's names (``layers.*`` -> ``model.layers.*``)."""
    prefix = getattr(model, "base_model_prefix", "")
    return {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's full TP plan with names from the top-level model (``model.layers.*.mlp.up_proj``)."""
    plan = getattr(model, "tp_plan", None)
    if plan:
        return dict(plan)
    # Older transformers: assemble it from the config's base-model plan and the class-level head plan.
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    plan.update(_from_base_plan(model, getattr(text_config(model), "base_model_tp_plan", None) or {}))
    return plan


# ------------------------------------------------------------------------------------------ source reading
def _uses(module: nn.Module, names: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Every (line, column) where ``module.forward``'s source uses ``self.<name>``, sorted, for the names it uses."""
    tree = forward_tree(type(module))
    found: dict[str, list[tuple[int, int]]] = {}
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr in names:
                found.setdefault(node.attr, []).append((node.lineno, node.col_offset))
    return {name: sorted(at) for name, at in found.items()}


def _first_uses(module: nn.Module, names: list[str]) -> dict[str, tuple[int, int]]:
    """(line, column) where ``module.forward``'s source first uses ``self.<name>``, for the names it uses."""
    return {name: at[0] for name, at in _uses(module, names).items()}


def forward_order(module: nn.Module, names: list[str]) -> dict[str, int] | None:
    """Where ``module.forward`` first uses ``self.<name>`` for each child name (source position), so the order
    in which the children run, not the order they were registered (OPT registers its final norm before its
    layers). None where the source cannot be read or does not name every child."""
    first = _first_uses(module, names)
    if set(first) != set(names):
        return None
    return {name: rank for rank, name in enumerate(sorted(first, key=first.get))}


def outputs_modified_in_place(module: nn.Module) -> set[str]:
    """Children of ``module`` whose output its forward modifies in place (``out = self.shared_expert(x)`` then
    ``out.add_(...)``: llama4's MoE), read from the source. Under TP such an output is a view that DTensor's
    ``to_local`` returned, which autograd forbids modifying in place, so TP clones it. Empty where unreadable."""
    tree = forward_tree(type(module))
    if tree is None:
        return set()
    bound: dict[str, str] = {}  # local name -> the child whose call produced it
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "self"):
            bound[node.targets[0].id] = node.value.func.attr
    changed = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                and node.func.value.id in bound and node.func.attr.endswith("_") and not node.func.attr.startswith("_")):
            changed.add(bound[node.func.value.id])
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id in bound:
            changed.add(bound[node.target.id])  # out += ...: in place on a tensor
    return changed


def output_arity(layer: nn.Module) -> int | None:
    """How many values a decoder layer's forward returns: 0 for a bare tensor (current transformers), n for the
    n-tuple of older families (``return output, attn_weights``: falcon, bloom), read from its return statements.
    A pipeline stage's stand-in for a layer it does not own must return the same shape of thing. None where the
    tuple is built at run time (``return (x,) + outputs``, or a name bound to a tuple: mvp, rwkv, trocr), whose
    length a stand-in cannot know."""
    tree = forward_tree(type(layer))
    if tree is None:
        return 0
    returns = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple)
             for t in n.targets if isinstance(t, ast.Name)}
    if any(isinstance(r, ast.Name) and r.id in bound or isinstance(r, ast.BinOp)
           and ast.Tuple in (type(r.left), type(r.right)) for r in returns):
        return None
    sizes = {len(r.elts) for r in returns if isinstance(r, ast.Tuple)}
    return max(sizes) if sizes else 0


# ------------------------------------------------------------------------------------------ sequence mixing
def _state_space_kernel(module: nn.Module) -> str | None:
    """A known kernel that mixes tokens outside the attention function: a recurrent / state-space /
    linear-attention scan, recognised by the decay it carries per head or channel (Mamba's and the gated delta
    rule's ``A_log`` and ``dt_bias``, RWKV's ``time_decay``, lightning attention's ``slope_rate`` and ``*_decay``
    buffers), or a sequence compressor (``compress_rate``)."""
    own = [name for name, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]
    found = [n for n in own if n in ("A_log", "dt_bias", "slope_rate") or "decay" in n.lower()]
    if found:
        return f"a recurrent / linear-attention / state-space scan ({', '.join(found)})"
    rate = getattr(module, "compress_rate", None)  # DeepSeek-V4's compressors: a window of tokens -> one KV entry
    if isinstance(rate, int) and rate > 1:
        return f"a compression of every {rate} tokens into one key/value entry"
    return None


def sequence_mixers(model: nn.Module) -> list[str]:
    """Modules in the decoder layers that mix tokens along the sequence outside transformers' AttentionInterface,
    described as ``name (ClassName: how)``; empty for a model whose layers mix tokens only in attention.

    Found from the modules themselves, not from family names: a 1-D convolution wider than one token (short
    convolutions, the causal conv before a Mamba or linear-attention scan), and the parameters of state-space or
    recurrent scans. A sequence split over ranks would cut these at every shard boundary.
    """
    found = find_layer_stack(model)
    if found is None:
        return []
    stack_name, layers = found
    mixers = []
    for name, module in layers.named_modules(prefix=stack_name):
        if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
            how = f"Conv1d over the sequence, kernel {module.kernel_size[0]}"
        else:
            how = _state_space_kernel(module)
        if how is not None:
            mixers.append(f"{name} ({type(module).__name__}: {how})")
    return mixers


# ----------------------------------------------------------------------------------------- the causal-LM head
def decoder_slot(model: nn.Module) -> str | None:
    """Name of the direct child a causal LM's forward calls for its last hidden state (``base_model_prefix``,
    e.g. "model"), or None where the model is not that shape (a base model, a custom wrapper)."""
    prefix = getattr(model, "base_model_prefix", "")
    child = model._modules.get(prefix) if prefix else None
    return prefix if isinstance(child, nn.Module) and child is not model else None


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a causal LM's forward may use after its decoder: the output head's (tied or not) and any
    others outside the decoder, deduplicated; empty where ``decoder_slot`` is None."""
    slot = decoder_slot(model)
    if slot is None:
        return []
    inside = {id(p) for p in model._modules[slot].parameters()}
    _, head = embedding_and_head(model)
    found = {id(p): p for p in (head.parameters() if head is not None else [])}
    found.update({id(p): p for p in model.parameters() if id(p) not in inside})
    return list(found.values())


# ------------------------------------------------------------------------------------------------- MLP
def _only_linears(module: nn.Module) -> list[nn.Linear]:
    """The Linears of ``module`` if every parameter in it belongs to one (LoRA's and quantized Linears count)."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    owned = {id(p) for lin in linears for p in lin.parameters()}
    return linears if all(id(p) in owned for p in module.parameters()) else []


def layer_mlp(layer: nn.Module, hidden_size: int) -> tuple[str, nn.Module] | None:
    """The decoder layer's per-token MLP: (child name, module), or None where there is not exactly one.

    Found from the module tree, not from names: the one direct child that holds only Linears (two or more), reads
    and writes the hidden size, and neither calls transformers' attention function nor mixes the sequence itself.
    A mixture of experts (expert weights outside Linears, a router) is not a per-token MLP of this kind.
    """
    found = []
    for name, child in layer.named_children():
        linears = _only_linears(child)
        if len(linears) < 2 or attention_keywords(type(child)):
            continue
        if any(isinstance(m, nn.Conv1d) or _state_space_kernel(m) for m in child.modules()):
            continue
        if any(lin.in_features == hidden_size for lin in linears) and any(lin.out_features == hidden_size
                                                                        for lin in linears):
            found.append((name, child))
    return found[0] if len(found) == 1 else None
