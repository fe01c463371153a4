"""The in-rank half of the chaos test (chaos.py): faults that must strike inside a rank at a chosen point.

``ChaosInjector`` is a ``TrainerCallback`` that `nd-parallel train` builds on every rank from the YAML's
``trainer_callbacks``. The harness arms a fault by writing ``armed-<id>.json`` into ``dir``; the rank it
names fires it once (``fired-<id>`` is created exclusively, so a restarted attempt never fires it again) and
appends an event with the wall-clock time to ``events.jsonl``, which the harness reads to time the detection:

- ``nan``: the input embeddings' output becomes NaN for one optimizer step (the loss and every gradient follow);
- ``save``: the rank writes its shard files of the next checkpoint, then SIGKILLs itself, before the checkpoint's
  metadata and completion marker exist (a death in the middle of a save);
- ``mismatch``: at the start of an attempt the rank's model config differs from the others' (a node started with
  a stale YAML), which the agreement check at prepare must name;
- ``end``: after the last step's checkpoint, the rank SIGKILLs itself (as a rank that aborts at exit would): the
  restart must find the run finished and train no further.

Kills at random steps, SIGSTOP and node failures come from outside (chaos.py), as they would on a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from transformers import TrainerCallback

ARMED = "armed-{}.json"
EVENTS = "events.jsonl"


def record_event(directory, **event) -> None:
    """Append one event (with ``t``, the wall-clock time) to ``events.jsonl``, on disk before this returns."""
    with open(Path(directory) / EVENTS, "a", encoding="utf-8") as f:
        f.write(json.dumps({**event, "t": time.time()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


class ChaosInjector(TrainerCallback):
    def __init__(self, dir: str):  # noqa: A002 (the YAML's argument name)
        self.dir = Path(dir)
        self.rank = int(os.environ.get("RANK", "0"))
        self._hook = None

    # ------------------------------------------------------------------------------------------ arming
    def _take(self, kind: str) -> dict | None:
        """An armed, not yet fired fault of ``kind`` aimed at this rank, or None."""
        for path in sorted(self.dir.glob(ARMED.format("*"))):
            try:
                fault = json.loads(path.read_text())
            except (OSError, ValueError):  # gone or half-written meanwhile: look again next time
                continue
            if (fault.get("kind") == kind and fault.get("rank") == self.rank
                    and not (self.dir / f"fired-{fault['id']}").exists()):
                return fault
        return None

    def _claim(self, fault: dict, **details) -> bool:
        try:
            os.close(os.open(self.dir / f"fired-{fault['id']}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        record_event(self.dir, id=fault["id"], kind=fault["kind"], rank=self.rank, **details)
        return True

    # ------------------------------------------------------------------------------------------ faults
    def on_init_end(self, args, state, control, model=None, **kwargs):
        fault = self._take("mismatch")
        if fault and model is not None and self._claim(fault, step=state.global_step):
            config = getattr(getattr(model, "base_model", model), "config", None) or model.config
            config.max_position_embeddings = int(config.max_position_embeddings) + 1  # what a stale YAML would do

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        fault = self._take("nan")
        if fault is None or state.global_step + 1 < fault["step"] or model is None:
            return
        if self._claim(fault, step=state.global_step + 1):
            self._hook = model.get_input_embeddings().register_forward_hook(lambda m, i, out: out * float("nan"))

    def on_step_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        fault = self._take("save")
        if fault is not None and control.should_save and state.global_step >= fault["step"]:
            self._die_in_next_write(fault, state.global_step)

    def _die_in_next_write(self, fault: dict, step: int) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        original = getattr(FileSystemWriter.write_data, "chaos_original", FileSystemWriter.write_data)
        injector = self

        def write_then_die(writer, plan, planner):
            result = original(writer, plan, planner)  # this rank's shard files are on disk
            if injector._claim(fault, step=step):
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        write_then_die.chaos_original = original
        FileSystemWriter.write_data = write_then_die

    def on_train_end(self, args, state, control, **kwargs):
        fault = self._take("end")
        if fault is not None and self._claim(fault, step=state.global_step):
            os.kill(os.getpid(), signal.SIGKILL)
