"""Split a decoder-only HF causal LM into pipeline stages by module name (pure: no process group).

A model is described by its *parts* (``nd_parallel.models.hf.model_parts``): the modules that run before the
decoder layers (embeddings), the layers, and the modules after them (final norm, lm_head). The first stage owns
the modules before the stack, the last stage those after it, and parameter-free modules run on every stage.

Default split (``"uniform"``): the layers are spread as evenly as possible over the ``pp_size *
pp_virtual_stages`` stages; when they don't divide, the extra layers go to the middle stages first (the
first and last stages already carry the embedding and the head), then to the first stage, then the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nd_parallel.models.hf import ModelParts


@dataclass
class StageSpec:
    index: int
    layers: list[int]
    modules: list[str] = field(default_factory=list)  # every FQN this stage owns (layers included)


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
