"""A causal LM on the meta device, from a local checkpoint directory or config.json: its real module tree, no storage.

Both the spec (shapes and parameter counts) and the op counter (which runs one- and two-layer copies) build models
here, so this module imports neither of them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from .errors import PlannerError


def load_config(model: str):
    """A transformers config from a checkpoint directory or a config.json path (local files only)."""
    from transformers import AutoConfig

    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PlannerError(f"MODEL={model!r} is a directory without config.json; pass a Hugging Face "
                               "checkpoint directory or the path of its config.json")
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise PlannerError(f"MODEL={model!r}: cannot read it as JSON ({err}); pass a config.json") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise PlannerError(f"MODEL={model!r} has no 'model_type'; pass a Hugging Face config.json")
        kind = data.pop("model_type")
        try:
            return AutoConfig.for_model(kind, **data)
        except ValueError as err:
            raise PlannerError(f"MODEL={model!r}: {err}") from None
    raise PlannerError(f"MODEL={model!r} does not exist; pass a local checkpoint directory or config.json "
                       "(the planner reads no hub and no weights)")


def meta_model(config) -> nn.Module:
    """The causal LM built on the meta device: real module tree, no storage."""
    from transformers import AutoModelForCausalLM

    try:  # skipping the init functions takes an 8B model from seconds to milliseconds (meta has no values anyway)
        from transformers.initialization import no_init_weights
    except ImportError:
        no_init_weights = contextlib.nullcontext
    with torch.device("meta"), no_init_weights():
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError as err:
            raise PlannerError(f"{type(config).__name__} is not a causal LM transformers can build: {err}") from None
    model.tie_weights()  # skipped with the init functions; tied embeddings count once
    return model
