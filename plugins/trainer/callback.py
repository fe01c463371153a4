"""``transformers.Trainer`` under any nd_parallel layout, from ``callbacks=[NDParallelCallback(config)]`` alone.

    from nd_parallel.plugins.trainer import NDParallelCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[NDParallelCallback(ParallelismConfig(tp_size=2))])

How the callback reaches the Trainer: a callback receives neither the trainer nor its accelerator, but
``on_init_end`` is called from inside ``Trainer.__init__`` (5.16 - 5.24), after the Accelerator exists and before
anything is prepared. So ``on_init_end`` walks up the call stack to the frame whose ``self`` is a Trainer holding
this very callback, and hands it to the library (``nd_parallel.plugins.trainer.adopt.adopt``). Chosen over patching
``Trainer.__init__`` at import or construction because it touches no class (other Trainers in the process, and
subclasses such as TRL's SFTTrainer, stay as they are) and needs nothing from the user but the callback.
"""

from __future__ import annotations

import inspect

from transformers import Trainer, TrainerCallback

from nd_parallel.accelerate.plugin import NDParallelPlugin
from nd_parallel.config import ParallelismConfig

from .adopt import adopt


def find_trainer(callback) -> Trainer:
    """The Trainer whose __init__ is calling us (see the module docstring)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            handler = getattr(owner, "callback_handler", None)
            if isinstance(owner, Trainer) and any(cb is callback for cb in getattr(handler, "callbacks", [])):
                return owner
            frame = frame.f_back
    finally:
        del frame
    raise RuntimeError("NDParallelCallback.on_init_end was not called by a transformers.Trainer's __init__; pass "
                       "the callback as Trainer(..., callbacks=[NDParallelCallback(config)])")


class NDParallelCallback(TrainerCallback):
    """Applies a ParallelismConfig to the Trainer it is passed to. Without one it takes ``accelerate launch``'s
    PARALLELISM_CONFIG_* layout; construct it before the Trainer (as an argument to it, it always is)."""

    def __init__(self, config: ParallelismConfig | None = None, **sizes):
        if config is None and not sizes:
            self.plugin = NDParallelPlugin.from_env()  # adjusts the launcher's env before the Accelerator exists
        else:
            self.plugin = NDParallelPlugin(config, **sizes)
        self.trainer = None

    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            self.trainer = find_trainer(self)
            self.plugin = adopt(self.trainer, self.plugin)
        return control
