"""A test-only Axolotl plugin: after training, rank 0 writes the Trainer's log_history (unrounded losses) to
output_dir/log_history.json, so that a plain Axolotl run and a run under the nd_parallel plugin compare exactly,
with the layout nd_parallel applied (None: the plugin was not attached) and the number of ranks."""

import json
import os

from axolotl.integrations.base import BasePlugin


class LossRecorder(BasePlugin):
    def __init__(self):
        super().__init__()
        self.trainer = None

    def post_trainer_create(self, cfg, trainer):
        self.trainer = trainer

    def post_train(self, cfg, model):
        if self.trainer is not None and self.trainer.is_world_process_zero():
            os.makedirs(cfg.output_dir, exist_ok=True)
            plugin = getattr(self.trainer, "nd_parallel", None)
            record = {"log_history": self.trainer.state.log_history,
                      "layout": plugin.config.describe() if plugin is not None else None,
                      "processes": self.trainer.accelerator.num_processes}
            with open(os.path.join(cfg.output_dir, "log_history.json"), "w", encoding="utf-8") as f:
                json.dump(record, f)
