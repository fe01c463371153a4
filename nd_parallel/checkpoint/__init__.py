"""Sharded checkpoints that resume exactly and load under any layout, and Hugging Face export.

- ``save_state`` / ``load_state`` (``state.py``): what ``accelerator.save_state`` / ``load_state`` do under the
  plugin: model, optimizer, schedulers, RNG, dataloader positions and step in one DCP checkpoint, HF-named;
  ``load_model_state`` reads back the model alone (the Trainer's best-checkpoint reload).
- ``save_model`` / ``export_checkpoint`` / ``full_state_dict`` (``export/``): HF safetensors from a sharded model,
  or offline from a checkpoint, written tensor by tensor; the full state dict on the main process.
- ``TrainState`` (``train_state.py``): what every call here acts on, handed over by the integration layer.
- ``format.py``: the directory layout, atomic publication, retention and the checks made before loading.
- ``dataloader.py``: how a prepared dataloader's position is kept and restored.
"""

from .dataloader import CheckpointWarning
from .export import export_checkpoint, full_state, full_state_dict, save_model
from .format import CheckpointError
from .state import load_model_state, load_state, save_state
from .train_state import TrainState

__all__ = ["CheckpointError", "CheckpointWarning", "TrainState", "export_checkpoint", "full_state", "full_state_dict",
           "load_model_state", "load_state", "save_model", "save_state"]
