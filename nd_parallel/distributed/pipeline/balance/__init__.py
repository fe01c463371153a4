"""Pipeline balance: how many decoder layers each stage gets, from measured per-unit costs.

A model is seen as a chain of *units* in execution order: the embedding (every ``pre`` module), one unit per
decoder layer, and the head (every ``post`` module plus the loss). The embedding is pinned to the first
stage and the head to the last; only the layers move. Three steps, each usable on its own:

    partition.partition(costs, S)        pure: the contiguous split minimising the slowest stage (exact DP)
    measure.profile_layers(model, b)     measures every unit's forward+backward time and memory on this rank
    collective.agree_costs(costs, group) every rank takes the same median of every rank's measurements

``collective.profile_balance`` chains them for ``pp_balance="profile"``. It runs at prepare time, on the whole
model, before the split: the stages (and so the optimizer's parameters) must exist when ``prepare`` returns,
so the real micro-batch is not known yet. It profiles a sample of ``(1, min(max_position_embeddings, 512))``
tokens unless told otherwise; what matters is the *ratio* of unit costs, and the embedding, the layers'
linear layers and the head all scale with the token count alike (only attention's quadratic part does not).

``layer_counts`` lives here, above the three, because both pipeline backends ask it: the torch backend's
split in ``pipeline/__init__.py`` and the DeepSpeed backend's build, which imports it from here rather than
from the package that imports the backend.
"""

from __future__ import annotations

import torch.nn as nn

from .collective import profile_balance


def layer_counts(config, num_layers: int, model: nn.Module | None = None, mesh=None) -> list[int] | None:
    """Layers per stage: the explicit list, a profile of ``model`` (a collective over ``mesh``), or None = uniform."""
    if isinstance(config.pp_balance, (list, tuple)):
        return list(config.pp_balance)
    if config.pp_balance == "profile":
        return profile_balance(model, mesh, config)  # every rank measures the whole model; all agree on one split
    return None
