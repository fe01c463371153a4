"""``transformers.Trainer`` under any nd_parallel layout: ``callbacks=[NDParallelCallback(config)]``.

callback.py finds the Trainer from its callback; adopt.py attaches nd_parallel to its Accelerator and turns the
Trainer habits a layout changes; preemption.py saves a checkpoint on SIGTERM/SIGINT (save_on_signal).
"""

from .callback import NDParallelCallback

__all__ = ["NDParallelCallback"]
