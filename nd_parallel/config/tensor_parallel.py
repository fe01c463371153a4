"""Tensor parallelism's options: overrides of the model's own TP plan, and sequence parallelism between its regions."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checks import ConfigTypeError, _kind


@dataclass(kw_only=True)
class TensorParallelOptions:
    """How each module is split across the tensor-parallel ranks, where the model's plan is not wanted."""

    tp_plan: dict[str, str | None] | None = None
    """Overrides of the model's TP plan: pattern -> style, or None to drop. Default None = as is."""
    sequence_parallel: bool | str = "auto"
    """Megatron-style sequence parallelism under TP: between the TP regions (norms, residual adds) activations are
    split on the sequence dim across the tp ranks. "auto" (default) = on where it is exact for the model (dense
    colwise/rowwise plans; MoE-style plans keep it off, logged with the reason); True = on, refused before any
    collective where not exact; False = off. Has no effect (a warning) with tp_size=1."""

    def _check_tensor_parallel(self) -> None:
        self.tp_plan = _check_tp_plan(self.tp_plan)
        self.sequence_parallel = _check_sequence_parallel(self.sequence_parallel, getattr(self, "tp_size", 1))


def _check_sequence_parallel(value: Any, tp_size: int) -> bool | str:
    if value not in (True, False, "auto") or not isinstance(value, (bool, str)):
        raise ConfigTypeError(f"sequence_parallel={value!r} is {_kind(value)}; use True, False or 'auto' (on "
                              "where exact, the default)")
    if value is True and tp_size == 1:
        warnings.warn("sequence_parallel=True has no effect with tp_size=1: sequence parallelism splits the "
                      "activations between TP regions across the tp ranks; set tp_size > 1, or drop "
                      "sequence_parallel", UserWarning, stacklevel=4)
    return value


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

