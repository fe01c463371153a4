"""``save_on_signal`` under ``transformers.Trainer``: after each optimizer step, every rank asks whether any rank got
SIGTERM/SIGINT (one all_reduce); if so the Trainer saves its checkpoint (sharded, through nd_parallel) and stops."""

from __future__ import annotations

import logging

from transformers import TrainerCallback

logger = logging.getLogger("nd_parallel")


class PreemptionCallback(TrainerCallback):
    def __init__(self, plugin):
        self.plugin = plugin
        self.preempted_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.preempted_at is None and self.plugin.preemption_requested():  # the same answer on every rank
            self.preempted_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            logger.warning("preempted: saving checkpoint-%d, then stopping", state.global_step)
        return control
