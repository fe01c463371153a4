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
STATE_MARKER = Path("nd_parallel") / "nd_parallel.json"  # plugins/trainer/adopt.STATE_DIR + checkpoint/format.MARKER


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


def agreed(resume: str | None, output_dir, restart: int) -> tuple[str | None, int]:
    """``choose`` on every rank, the same answer everywhere: (checkpoint, restart) after the process group exists.

    Ranks on different nodes can disagree without this: a replacement node's agent counts its attempts from 0
    while the survivors' count on (so only they would take the latest checkpoint when resume is not ``auto``), and
    a shared file system may show one node a checkpoint another does not see yet. The attempt is the highest
    count of any rank; a checkpoint some ranks do not see stops the run on every rank, naming it.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return choose(resume, output_dir, restart), restart
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, restart)
    restart = max(counts)
    choices = [None] * dist.get_world_size()
    dist.all_gather_object(choices, choose(resume, output_dir, restart))
    if len(set(choices)) > 1:
        seen = {c: [r for r, x in enumerate(choices) if x == c] for c in dict.fromkeys(choices)}
        raise RuntimeError("ranks would resume from different checkpoints: " + "; ".join(
            f"ranks {','.join(map(str, ranks))}: {c or 'none (a fresh start)'}" for c, ranks in seen.items())
            + f". Every node must see the same {output_dir} (a shared file system, synced before the restart)")
    return choices[0], restart


def _step_of(checkpoint: str) -> int:
    return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])


def finished(checkpoint: str | None) -> bool:
    """Whether the run had already reached its last step at ``checkpoint`` (a restart after the final save, e.g. a
    rank that failed at exit): resuming there would make the Trainer take one step more than max_steps."""
    if checkpoint is None:
        return False
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return int(state.get("max_steps") or 0) > 0 and int(state["global_step"]) >= int(state["max_steps"])


def account(checkpoint: str | None, log_file, restart: int) -> str | None:
    """On the main process of a resumed or restarted run: cut ``log_file`` (one JSON object per step) back to the
    step it continues from, so that the log stays one line per step, and say how many logged steps were lost."""
    log = Path(log_file)
    if checkpoint is None and restart == 0:
        return None
    step = _step_of(checkpoint) if checkpoint else 0
    lines = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []  # none: failed before step 1
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    reached = max((json.loads(line).get("step", 0) for line in lines if line.strip()), default=step)
    log.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    what = f"restart {restart}" if restart else "resume"
    start = (f"resuming from {Path(checkpoint).name} (step {step})" if checkpoint else
             "no complete checkpoint yet, starting again (step 0)")
    return (f"[nd_parallel] {what}: {start}; the interrupted run had logged step {reached}: "
            f"{max(0, reached - step)} steps lost")


def init_restarted_process_group(restart: int, environ=None) -> None:
    """On a restart (attempt ``restart`` > 0), create the default process group over a store prefix of its own.

    For one node (torchrun's static rendezvous), whose one agent counts every attempt. Several nodes launched by
    ``launch.Nodes`` do not share the store between attempts, so nothing is left to prefix there.

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
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # every attempt has a fresh store of its own (launch.Nodes)
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=30))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=dist.PrefixStore(f"nd_parallel/attempt_{restart}", store),
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))
