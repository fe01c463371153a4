"""Axolotl's ``dynamic_checkpoint``: save a checkpoint when asked during training, by creating a file.

``dynamic_checkpoint: {enabled: true, check_interval: N, trigger_file_path: NAME}``: every N optimizer steps rank 0
looks for ``output_dir/NAME`` (default ``axolotl_checkpoint.save``); when it is there it is deleted and every rank
saves a checkpoint at that step (the Trainer's ``control.should_save``: nd_parallel's sharded state, resumable),
Axolotl's meaning. Rank 0's answer reaches the other ranks in one broadcast, so all of them save or none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from transformers import TrainerCallback

DEFAULT_FILE = "axolotl_checkpoint.save"
KEYS = ("enabled", "check_interval", "trigger_file_path")


@dataclass(kw_only=True)
class TriggerSaveOptions:
    dynamic_checkpoint: dict | None = None
    """{enabled: true, check_interval: N (default 100), trigger_file_path: NAME}: touch output_dir/NAME (default
    axolotl_checkpoint.save) and a checkpoint is saved at the next step that is a multiple of N."""


def refusals(d: dict) -> list[str]:
    value = d.get("dynamic_checkpoint")
    if value is None:
        return []
    if not isinstance(value, dict) or set(value) - set(KEYS):
        return [f"dynamic_checkpoint={value!r}: write a mapping of {', '.join(KEYS)}, e.g. {{enabled: true, "
                "check_interval: 10}}"]
    interval, name = value.get("check_interval", 100), value.get("trigger_file_path") or DEFAULT_FILE
    out = [] if isinstance(value.get("enabled", False), bool) else [
        f"dynamic_checkpoint.enabled={value['enabled']!r}; use true or false"]
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        out.append(f"dynamic_checkpoint.check_interval={interval!r}: write an integer >= 1 (steps)")
    if not isinstance(name, str) or os.path.basename(name) != name:
        out.append(f"dynamic_checkpoint.trigger_file_path={name!r}: write a file name (it is looked for in "
                   "output_dir), not a path")
    return out


def callbacks(t) -> list:
    value = t.dynamic_checkpoint or {}
    if not value.get("enabled"):
        return []
    return [TriggerSave(value.get("check_interval", 100), value.get("trigger_file_path") or DEFAULT_FILE)]


class TriggerSave(TrainerCallback):
    def __init__(self, every: int, name: str):
        self.every, self.name = every, name

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"[nd_parallel] dynamic_checkpoint: touch {os.path.join(args.output_dir, self.name)} to save a "
                  f"checkpoint (looked for every {self.every} steps)", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return control
        path = os.path.join(args.output_dir, self.name)
        asked = state.is_world_process_zero and os.path.exists(path)
        if asked:
            os.remove(path)
        if _agreed(asked):
            control.should_save = True
        return control


def _agreed(asked: bool) -> bool:
    """Rank 0's answer on every rank (one broadcast over the default group; none without a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return asked
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([int(asked)], dtype=torch.long, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())
