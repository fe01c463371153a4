"""Hugging Face files out of a run: the full model, a PEFT adapter or the merged model (online, every rank takes
part), and HF safetensors from a ``save_state`` checkpoint (offline, one process).

- writer.py: the safetensors writer every export shares (one tensor at a time) and ``config.json``.
- gather.py: which ranks hold which tensor, and each tensor made whole in turn (collective).
- full.py, adapter.py: ``accelerator.save_model`` of a full model / of a PeftModel; ``get_state_dict``.
- offline.py: ``nd-parallel export``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from nd_parallel.models.peft import peft_wrapper

from ..train_state import TrainState
from .full import full_state_dict, save_full
from .gather import full_state
from .offline import export_checkpoint, read_tensors
from .writer import write_model_config

__all__ = ["export_checkpoint", "full_state", "full_state_dict", "read_tensors", "save_model", "write_model_config"]


def save_model(state: TrainState, model: nn.Module, save_directory, max_shard_size="10GB",
               safe_serialization: bool = True, merge_adapter: bool = False) -> Path:
    """``accelerator.save_model``: HF safetensors + config.json; a PEFT model writes its adapter, or with
    ``merge_adapter=True`` the base model with the adapter folded in."""
    if not safe_serialization:
        raise ValueError("safe_serialization=False would write pickled weights; nd_parallel writes safetensors "
                         "only: drop the argument")
    out_dir = Path(os.path.expanduser(str(save_directory)))
    if out_dir.is_file():
        raise ValueError(f"save_model: {out_dir} is a file; pass a directory")
    if merge_adapter and peft_wrapper(model) is None:
        raise ValueError(f"save_model(merge_adapter=True): {type(model).__name__} carries no PEFT adapter; "
                         "drop merge_adapter")
    if peft_wrapper(model) is None:
        return save_full(state, model, out_dir, max_shard_size)
    from .adapter import save_adapter, save_merged

    return save_merged(state, model, out_dir, max_shard_size) if merge_adapter else save_adapter(state, model,
                                                                                                 out_dir)
