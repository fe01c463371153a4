"""Which checkpoint a (re)started `nd-parallel train` resumes from, and what the interruption cost.

A Trainer checkpoint ``output_dir/checkpoint-<step>`` is complete once both its sharded state
(``nd_parallel/nd_parallel.json``, the marker written last by ``save_state``, after every rank's files) and the
Trainer's ``trainer_state.json`` (written after the state) exist. A save that died half-way misses one of them and is
passed over, so the previous checkpoint stays the latest.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

logger = logging.getLogger("nd_parallel")

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_MARKER = Path("nd_parallel") / "nd_parallel.json"  # hf_trainer.STATE_DIR + checkpoint/format.MARKER


def complete_checkpoints(output_dir) -> list[Path]:
    """Complete ``checkpoint-<step>`` folders under ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / STATE_MARKER).is_file() and (p / "trainer_state.json").is_file()]


def choose(resume: str | None, output_dir, restart: int) -> str | None:
    """The checkpoint to resume from: ``auto`` (and every restart after a failure) takes the latest complete one
    under ``output_dir`` (None: start fresh); a PATH is taken as given, unless a restart finds a newer one."""
    latest = complete_checkpoints(output_dir)
    if resume == "auto" or (restart > 0 and latest):
        return str(latest[-1]) if latest else None
    return resume


def _step_of(checkpoint: str) -> int:
    return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])


def account(checkpoint: str | None, log_file, restart: int) -> str | None:
    """On the main process of a resumed run: cut ``log_file`` (one JSON object per step) back to the checkpoint's
    step, so that the log stays one line per step, and say how many logged steps the interruption cost."""
    log = Path(log_file)
    if checkpoint is None or not log.is_file():
        return None
    step = _step_of(checkpoint)
    lines = log.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    reached = max((json.loads(line).get("step", 0) for line in lines if line.strip()), default=step)
    log.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    what = f"restart {restart}" if restart else "resume"
    return (f"[nd_parallel] {what}: resuming from {Path(checkpoint).name} (step {step}); the interrupted run had "
            f"logged step {reached}: {max(0, reached - step)} steps lost")


def init_restarted_process_group(restart: int, environ=None) -> None:
    """On a restart (attempt ``restart`` > 0), create the default process group over a store prefix of its own.

    torch 2.13's elastic agent keeps one TCPStore across attempts and its workers no longer prefix their keys per
    attempt ("a new TCPStore for every retry", rendezvous.py), so a restarted rank that reaches
    ``init_process_group`` first reads its peer's gloo address from the dead attempt and fails with "Gloo
    connectFullMesh failed ... Connection refused" (5 of 6 restarts here; 0 of 5 since). Called at the rank's
    entry point, before the Trainer's Accelerate state creates the group, which then finds it and uses it.
    """
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    if restart <= 0 or dist.is_initialized() or int(env.get("WORLD_SIZE", "1")) <= 1:
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=30))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=dist.PrefixStore(f"nd_parallel/attempt_{restart}", store),
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))
