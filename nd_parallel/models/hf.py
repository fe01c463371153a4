"""The one place that knows the structure of a Hugging Face causal LM.

Every other module asks here: which config is the text config, which ModuleList holds the decoder layers (and so
which modules are the layers FSDP shards and checkpointing wraps, and which the pipeline cuts), which modules come
before and after that stack, where the embedding and the head are and whether they share a weight, and the
model's own tensor- and pipeline-parallel plans. Answers come from the model's own metadata (its ``pp_plan``,
``_no_split_modules``, ``get_input_embeddings`` / ``get_output_embeddings``, ``base_model_tp_plan``), never from a
list of family names, so a new family is understood the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


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

    Around the stack the module tree decides (a plan's dict order is not execution order): modules registered
    before the stack come first, modules after it and the outer model's heads last, and modules without
    parameters (rotary embeddings, dropout) are shared by every stage.
    """
    layers_fqn, layers = layer_stack(model)
    parent_fqn, _, _ = layers_fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    prefix = f"{parent_fqn}." if parent_fqn else ""
    pre, post, shared = [], [], []
    seen_layers = False
    for name, child in parent.named_children():
        fqn = prefix + name
        if fqn == layers_fqn:
            seen_layers = True
        elif not _has_params(child):
            shared.append(fqn)
        else:
            (post if seen_layers else pre).append(fqn)
    # Modules of the outer model beside the base model (lm_head, or a score head) come last.
    for name, child in model.named_children():
        if not (parent_fqn == name or parent_fqn.startswith(name + ".")) and _has_params(child):
            post.append(name)
    if not pre:
        raise UnsplittableModel(
            f"{type(model).__name__}: found no embedding before {layers_fqn}; nd_parallel splits decoder-only "
            "causal LMs (embeddings -> layers -> norm -> head); use pp_size=1 for this model")
    return ModelParts(tuple(pre), layers_fqn, len(layers), tuple(post), tuple(shared))


# --------------------------------------------------------------------------------- embeddings and head
def embedding_and_head(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return emb, head


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
    module = getattr(model, getter)() if hasattr(model, getter) else None
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
