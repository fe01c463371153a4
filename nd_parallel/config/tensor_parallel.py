"""Tensor parallelism's option: overrides of the model's own TP plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checks import ConfigTypeError, _kind


@dataclass(kw_only=True)
class TensorParallelOptions:
    """How each module is split across the tensor-parallel ranks, where the model's plan is not wanted."""

    tp_plan: dict[str, str | None] | None = None
    """Overrides of the model's TP plan: pattern -> style, or None to drop. Default None = as is."""

    def _check_tensor_parallel(self) -> None:
        self.tp_plan = _check_tp_plan(self.tp_plan)


def _check_tp_plan(plan: Any) -> dict[str, str | None] | None:
    """A plain dict copy of `plan`, so that later changes to the caller's mapping do not reach the config."""
    example = "{'layers.*.mlp.down_proj': 'rowwise'}"
    if plan is not None and not isinstance(plan, Mapping):
        raise ConfigTypeError(f"tp_plan={plan!r} is {_kind(plan)}; expected a dict of module "
                              f"pattern -> style such as {example}, or None for the model's plan")
    for key, style in (plan or {}).items():
        if not isinstance(key, str):
            raise ConfigTypeError(f"tp_plan key {key!r} is {_kind(key)}; keys are module name "
                                  f"patterns (str) such as {example}")
        if style is not None and not isinstance(style, str):
            raise ConfigTypeError(f"tp_plan[{key!r}]={style!r} is {_kind(style)}; values are style "
                                  "names such as 'colwise' or 'rowwise', or None to drop the entry")
    return None if plan is None else dict(plan)
