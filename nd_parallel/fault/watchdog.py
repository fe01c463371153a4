"""Hang detection: a thread per rank that notices when this rank has waited too long in one collective, finds out
which ranks are missing, prints one line and ends every process.

What torch gives and we use: the default store (the TCPStore torchrun's agent or rank 0 serves; ``clone()`` opens
a second connection so the heartbeat never queues behind the main thread), process-group timeouts as a backstop
(``_set_pg_timeout``), and on CUDA NCCL's own watchdog and flight recorder. What we wrote: the heartbeat protocol
below, reading where a rank stands from its stack (``where.py``), and the one-line report.

The protocol, every ``beat`` seconds on each rank:
  1. publish ``{beat, step, where, waited, pid, host}`` under ``rank/<r>`` in the store;
  2. if the ``abort`` key exists, another rank found a hang: print this rank's line and exit(1);
  3. if the main thread has been inside the same torch.distributed call for ``hang_timeout - 5 beats``, read every
     rank's record, read again three beats later (a rank whose counter did not move is stopped or dead; one that
     beats but stands outside any collective is busy, e.g. in an endless loop; one in another collective called
     something this rank did not), publish ``abort``, print the line, kill stopped ranks on this host (a stopped
     process runs no handler) and exit(1).
So a hang is reported by every live rank at most ``hang_timeout`` after the last rank stopped making progress.
Only a rank that waits investigates, so a healthy step costs two small store operations per beat and no
collective. A legitimately long wait (rank 0 writing a large file while the others sit in a barrier) counts as a
hang once it exceeds ``hang_timeout``: choose it above the longest such wait, as with NCCL's timeout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .where import Position, position_of

logger = logging.getLogger("nd_parallel")

DEFAULT_TIMEOUT = {"cuda": 600.0, "cpu": 1800.0}  # the backends' own defaults (NCCL 10 min, gloo 30 min)
_INVESTIGATE_BEATS = 3


def resolve_timeout(hang_timeout: float | None, device_type: str) -> float:
    """Seconds, or 0 for off. None = the backend's own collective timeout, now with a report that names the rank."""
    if hang_timeout is None:
        return DEFAULT_TIMEOUT.get(device_type, DEFAULT_TIMEOUT["cuda"])
    return float(hang_timeout)


def beat_for(timeout: float) -> float:
    return min(5.0, max(0.25, timeout / 20))


class Watchdog:
    """One per process; ``start()`` after the process group exists, ``stop()`` before it is destroyed."""

    def __init__(self, hang_timeout: float, group_names: dict[str, str], *, store=None, exit_fn=os._exit):
        self.timeout = float(hang_timeout)
        self.beat = beat_for(self.timeout)
        self.threshold = max(self.beat, self.timeout - (_INVESTIGATE_BEATS + 2) * self.beat)
        self.names = group_names
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.step = 0  # optimizer steps taken, set by the plugin's optimizer hook
        self._store = store if store is not None else _own_store(self.beat)
        self._exit = exit_fn
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nd_parallel-watchdog", daemon=True)
        self._count = 0
        self._key, self._since = None, time.monotonic()
        self._pending: tuple[float, dict] | None = None  # (when, first reading) of an investigation under way
        self.report: str | None = None
        self.on_report = None  # called with the line once it is printed (tests record when)

    # -------------------------------------------------------------------------------------------- life
    def start(self) -> "Watchdog":
        self._publish(Position())
        self._thread.start()
        logger.info("hang detection on: hang_timeout=%.0fs, heartbeat every %.2fs", self.timeout, self.beat)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.beat + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.beat):
            try:
                self._tick()
            except Exception as err:  # a store hiccup must not end the thread: the next beat tries again
                logger.debug("watchdog beat failed: %s", err)

    # -------------------------------------------------------------------------------------------- beat
    def _tick(self) -> None:
        now = time.monotonic()
        pos = position_of(self._main, self.names)
        if not pos.collective or pos.key != self._key:
            self._key, self._since, self._pending = pos.key, now, None
        waited = now - self._since if pos.collective else 0.0
        self._publish(pos, waited)
        if self._store.check(["abort"]):
            self._abort_from_peer(pos, waited)
        elif waited >= self.threshold:
            self._investigate(pos, waited, now)

    def _publish(self, pos: Position, waited: float = 0.0) -> None:
        self._count += 1
        record = {"beat": self._count, "step": self.step, "where": pos.describe(), "in": bool(pos.collective),
                  "waited": round(waited, 1), "pid": os.getpid(), "host": socket.gethostname()}
        self._store.set(f"rank/{self.rank}", json.dumps(record))

    def _records(self) -> dict[int, dict]:
        keys = [f"rank/{r}" for r in range(self.world)]
        present = [k for k in keys if self._store.check([k])]
        return {int(k.split("/")[1]): json.loads(v) for k, v in zip(present, self._store.multi_get(present))}

    def _investigate(self, pos: Position, waited: float, now: float) -> None:
        if self._pending is None:
            self._pending = (now, self._records())
            return
        started, first = self._pending
        if now - started < _INVESTIGATE_BEATS * self.beat:
            return
        second = self._records()
        missing, stopped = _missing(self.rank, pos, first, second, now - started)
        line = (f"[nd_parallel] hang: rank {self.rank} at step {self.step} waits {pos.describe()} for {waited:.0f} s "
                f"(hang_timeout={self.timeout:.0f}s); missing: {'; '.join(missing) or 'none (every rank waits here)'}")
        self._store.set("abort", json.dumps({"by": self.rank, "missing": missing}))
        self._say(line)
        # Stay two beats so that live peers read "abort" and print their own line before the launcher, seeing this
        # rank exit, signals them.
        time.sleep(2 * self.beat)
        for peer in stopped:
            _kill_if_local(second.get(peer, first.get(peer)))
        self._finish(line, printed=True)

    def _abort_from_peer(self, pos: Position, waited: float) -> None:
        info = json.loads(self._store.get("abort"))
        if info["by"] == self.rank:
            return
        held = f" for {waited:.0f} s" if pos.collective else ""
        line = (f"[nd_parallel] hang reported by rank {info['by']}: rank {self.rank} at step {self.step} stands "
                f"{pos.describe()}{held}; missing: {'; '.join(info['missing']) or 'none'}")
        self._finish(line)

    def _say(self, line: str) -> None:
        self.report = line
        print(line, file=sys.stderr, flush=True)
        if self.on_report is not None:
            self.on_report(line)

    def _finish(self, line: str, printed: bool = False) -> None:
        if not printed:
            self._say(line)
        self._stop.set()
        self._exit(1)


def _missing(me: int, pos: Position, first: dict, second: dict, span: float) -> tuple[list[str], list[int]]:
    """Describe every rank of the group this rank waits on that is not waiting in the same place."""
    peers = [r for r in (pos.ranks or sorted(set(first) | set(second))) if r != me]
    missing, stopped = [], []
    for r in peers:
        a, b = first.get(r), second.get(r)
        if b is None:
            missing.append(f"rank {r} (never started hang detection)")
        elif a is not None and a["beat"] == b["beat"]:
            missing.append(f"rank {r} (no heartbeat over the last {span:.1f} s: stopped or dead; its last one was "
                           f"at step {b['step']}, {b['where']})")
            stopped.append(r)
        elif not b["in"]:
            missing.append(f"rank {r} (alive, step {b['step']}, {b['where']}: busy, e.g. an endless loop)")
        elif b["where"] != pos.describe():
            missing.append(f"rank {r} (step {b['step']}, waits {b['where']}: a collective only some ranks call)")
    return missing, stopped


def _kill_if_local(record: dict | None) -> None:
    """SIGKILL a stopped rank on this host: SIGSTOP'd, it would never run a SIGTERM handler nor exit by itself."""
    if record and record.get("host") == socket.gethostname():
        try:
            os.kill(int(record["pid"]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _own_store(beat: float):
    """A second connection to the default store, with a short timeout, used by the watchdog thread only."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store().clone()
    store.set_timeout(timedelta(seconds=max(10.0, 4 * beat)))
    return dist.PrefixStore("nd_parallel_watchdog/", store)


def set_backstop_timeouts(groups, hang_timeout: float, device_type: str) -> None:
    """Set the process groups' own timeout: on CUDA to hang_timeout (NCCL's watchdog then catches what the stack
    cannot show, e.g. a host blocked in cudaStreamSynchronize, and its flight recorder names the collective); on
    gloo to hang_timeout + 60 s, a backstop should this thread be unable to run."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    seconds = hang_timeout if device_type == "cuda" else hang_timeout + 60
    for group in groups:
        try:
            _set_pg_timeout(timedelta(seconds=seconds), group)
        except Exception as err:  # older backends without the setter keep their default
            logger.debug("could not set the timeout of %s: %s", group, err)
