"""Where a mixture-of-experts model keeps its experts: the modules expert parallelism splits.

Read from the model's own ``base_model_ep_plan`` (transformers 5: ``"layers.*.mlp.experts": "ep_dispatch_experts"``
names the module, ``"grouped_gemm"`` its stacked weights) where the config has one, else from the structure: a
module whose every direct parameter is stacked over the experts (``[num_experts, ...]``) and whose forward takes
``(hidden_states, top_k_index, top_k_weights)``, the calling convention of transformers' MoE experts modules.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch.nn as nn

from .hf import text_config

# Config fields that hold the number of routed experts, across families (transformers' attribute_map makes
# num_local_experts an alias on most, but not all, MoE configs).
_EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ExpertsModule:
    """One MoE layer's experts: its name, the module, and its stacked parameters (split along dim 0)."""

    name: str
    module: nn.Module
    stacked: tuple[str, ...]


def num_experts(model_or_config) -> int | None:
    """The number of routed experts the config declares, or None for a dense model."""
    config = text_config(model_or_config)
    for field in _EXPERT_COUNT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


def _pattern(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def _plan_modules(model: nn.Module, plan: dict) -> list[str]:
    """Module names that the ep plan marks as experts, under the top-level model's names."""
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    regexes = [_pattern(prefix + key) for key, style in plan.items() if style == "ep_dispatch_experts"]
    return [name for name, _ in model.named_modules() if any(r.match(name) for r in regexes)]


def _takes_routing(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


def _stacked(module: nn.Module, count: int) -> tuple[str, ...]:
    """The direct parameters stacked over the experts, or () when any direct parameter is not."""
    direct = list(module.named_parameters(recurse=False))
    if not direct or any(p.dim() < 2 or p.shape[0] != count for _, p in direct):
        return ()
    return tuple(n for n, _ in direct)


def expert_modules(model: nn.Module) -> list[ExpertsModule]:
    """Every MoE experts module of ``model`` (empty for a dense model), in module order."""
    count = num_experts(model)
    if count is None:
        return []
    plan = getattr(text_config(model), "base_model_ep_plan", None) or {}
    names = _plan_modules(model, plan) if plan else []
    modules = dict(model.named_modules())
    if not names:  # no plan: find the structure
        names = [n for n, m in modules.items() if _stacked(m, count) and _takes_routing(m)]
    found = []
    for name in names:
        stacked = _stacked(modules[name], count)
        if stacked:
            found.append(ExpertsModule(name, modules[name], stacked))
    return found
