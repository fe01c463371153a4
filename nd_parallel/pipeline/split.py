"""Split a decoder-only HF causal LM into pipeline stages by module name (pure: no process group).

A model is described by its *parts*: the modules that run before the decoder layers (embeddings), the
layers, and the modules after them (final norm, lm_head). The layer stack is the ModuleList the model's own
``pp_plan`` names where transformers defines one (``base_model_pp_plan``), otherwise the longest ModuleList.
Around it the module tree decides (the plan's dict order is not execution order): modules registered before
the stack belong to the first stage, modules after it and the head to the last stage, and modules without
parameters (rotary embeddings, dropout) run on every stage.

Default split (``"uniform"``): the layers are spread as evenly as possible over the ``pp_size *
pp_virtual_stages`` stages; when they don't divide, the extra layers go to the middle stages first (the
first and last stages already carry the embedding and the head), then to the first stage, then the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn


@dataclass(frozen=True)
class ModelParts:
    """Fully-qualified module names of a causal LM, in execution order."""

    pre: tuple[str, ...]  # embeddings etc.: first stage
    layers_fqn: str  # the ModuleList of decoder layers, e.g. "model.layers"
    num_layers: int
    post: tuple[str, ...]  # final norm, lm_head: last stage
    shared: tuple[str, ...] = ()  # parameter-free helpers every stage runs (rotary embeddings)


@dataclass
class StageSpec:
    index: int
    layers: list[int]
    modules: list[str] = field(default_factory=list)  # every FQN this stage owns (layers included)


class UnsplittableModel(ValueError):
    """The model has no structure we can cut into stages; the message says why."""


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


def _layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    from_plan = _plan_layer_stack(model)
    if from_plan is not None:
        return from_plan
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise UnsplittableModel(
            f"{type(model).__name__} has no ModuleList of decoder layers, so it cannot be cut into pipeline "
            "stages; use pp_size=1"
        )
    return max(lists, key=lambda item: len(item[1]))


def model_parts(model: nn.Module) -> ModelParts:
    """Describe ``model`` as pre / layers / post modules (HF names), from its pp_plan or its module tree."""
    layers_fqn, layers = _layer_stack(model)
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
            "causal LMs (embeddings -> layers -> norm -> head); use pp_size=1 for this model"
        )
    return ModelParts(tuple(pre), layers_fqn, len(layers), tuple(post), tuple(shared))


def uniform_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage for the default split (see the module docstring for where extras go)."""
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def check_layer_counts(counts: list[int], num_layers: int, num_stages: int) -> None:
    if len(counts) != num_stages:
        raise ValueError(
            f"pp_balance lists {len(counts)} stages but pp_size * pp_virtual_stages = {num_stages}; "
            f"give one layer count per stage"
        )
    if sum(counts) != num_layers:
        raise ValueError(f"pp_balance={counts} sums to {sum(counts)}, but the model has {num_layers} layers")
    empty = [i for i, c in enumerate(counts) if c < 1 and 0 < i < num_stages - 1]
    if any(c < 0 for c in counts) or empty:
        raise ValueError(f"pp_balance={counts}: every middle stage needs at least one layer and none may be negative")


def split_stages(parts: ModelParts, num_stages: int, counts: list[int] | None = None) -> list[StageSpec]:
    """Module names per stage: the first owns ``pre``, the last owns ``post``, all run the ``shared`` helpers."""
    if num_stages > parts.num_layers:
        raise ValueError(
            f"pp_size * pp_virtual_stages = {num_stages} stages but the model has only {parts.num_layers} layers; "
            f"use at most {parts.num_layers} stages"
        )
    counts = list(counts) if counts is not None else uniform_layers(parts.num_layers, num_stages)
    check_layer_counts(counts, parts.num_layers, num_stages)
    stages, start = [], 0
    for index, count in enumerate(counts):
        layers = list(range(start, start + count))
        start += count
        modules = [f"{parts.layers_fqn}.{i}" for i in layers] + list(parts.shared)
        if index == 0:
            modules = list(parts.pre) + modules
        if index == num_stages - 1:
            modules += list(parts.post)
        stages.append(StageSpec(index, layers, modules))
    return stages


def stage_ids_for_rank(pp_rank: int, pp_size: int, virtual: int, style: str = "loop") -> list[int]:
    """Which stages a pp rank runs: round-robin ("loop": r, r+p, ...) or V-shape ("v": r, 2p-1-r)."""
    if style == "v":
        if virtual != 2:
            raise ValueError(f"a V-shaped schedule places exactly 2 stages per rank, got pp_virtual_stages={virtual}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + v * pp_size for v in range(virtual)]
