"""The one way in: `plan(model, training, cluster, constraints)` -> PlanResult.

`nd-parallel plan`, `ParallelismConfig.auto` and `layout: auto` all plan through it, so a model given as a path, a
module or an already-read ModelSpec is turned into the same spec the same way everywhere.
"""

from __future__ import annotations

import os

from .errors import PlannerError
from .layout import Cluster, Training
from .search import Constraints, PlanResult, search
from .spec import ModelSpec, model_spec, spec_from_path


def spec_of(model, lora_targets: tuple[str, ...] | None = None) -> ModelSpec:
    """The ModelSpec of `model`: a ModelSpec as is, a checkpoint directory or config.json path built on the meta
    device, or a causal LM module (meta or real) read directly. `lora_targets` names the Linears a LoRA adapter
    wraps (None: every Linear); a ModelSpec was read with its targets already, so it takes none."""
    if isinstance(model, ModelSpec):
        if lora_targets is not None:
            raise PlannerError("lora_targets apply when the model is read; this ModelSpec was read already, so "
                               "pass lora_targets to spec_from_path/model_spec instead")
        return model
    if isinstance(model, (str, os.PathLike)):
        return spec_from_path(os.fspath(model), lora_targets=lora_targets)
    return model_spec(model, lora_targets=lora_targets)


def plan(model, training: Training, cluster: Cluster, constraints: Constraints | None = None, *,
         lora_targets: tuple[str, ...] | None = None) -> PlanResult:
    """Every legal layout of `cluster` for training `model` as `training` describes, ranked by predicted step time
    (fastest first), with the rejected layouts and their reasons and a hint; `constraints` pins sizes and knobs.

    PlannerError when the request itself is impossible (contradictory pins, no legal layout at all); a request
    nothing fits in memory returns no plans and says in `hint` which knob helps most."""
    return search(spec_of(model, lora_targets), training, cluster, Constraints() if constraints is None else constraints)
