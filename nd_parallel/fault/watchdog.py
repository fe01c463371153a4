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
Where the store lives in rank 0's process (several nodes: each attempt's store is served by its rank 0), a stopped
rank 0 silences the store too; a rank that has waited for the threshold and whose store stopped answering then
reports that (``_store_unreachable``), within about ``hang_timeout`` plus the store's own timeout.
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
        # longer than any healthy beat (an investigation sleeps two beats) and than the store's own timeout
        self._stuck_after = _store_timeout(self.beat) + 2 * self.beat
        self._closed = False
        self._exit = exit_fn
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nd_parallel-watchdog", daemon=True)
        self._count = 0
        self._key, self._since = None, time.monotonic()
        self._pending: tuple[float, dict] | None = None  # (when, first reading) of an investigation under way
        self._store_down_since: float | None = None  # when the store last stopped answering
        self._peers: dict[int, dict] | None = None  # every rank's first record (pid, host), read once all beat
        self.report: str | None = None
        self.on_report = None  # called with the line once it is printed (tests record when)

    # -------------------------------------------------------------------------------------------- life
    def start(self) -> "Watchdog":
        self._publish(Position())
        self._thread.start()
        logger.info("hang detection on: hang_timeout=%.0fs, heartbeat every %.2fs", self.timeout, self.beat)
        return self

    def stop(self) -> None:
        self._closed = True  # a beat still running (an investigation) must not end a process that is ending well
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.beat + 5)

    def _run(self) -> None:
        """Each beat runs in a short-lived daemon thread of its own, so that a store call that never returns (a
        TCPStore whose host is SIGSTOPped answers nothing, and a call after a timed-out one can block for good)
        cannot silence this loop: a beat still running after the store's timeout counts as an unreachable store."""
        beat: _Beat | None = None
        while not self._stop.wait(self.beat):
            if beat is not None and beat.is_alive():
                stuck = time.monotonic() - beat.started
                if stuck >= self._stuck_after:
                    self._store_unreachable(TimeoutError(f"a store call has not returned for {stuck:.0f} s"),
                                            since=beat.started)
                continue
            if beat is not None and beat.error is not None:  # a store hiccup: the next beat tries again
                logger.debug("watchdog beat failed: %s", beat.error)
                self._store_unreachable(beat.error)
            elif beat is not None:
                self._store_down_since = None
            beat = _Beat(self._tick)
            beat.start()

    # -------------------------------------------------------------------------------------------- beat
    def _where(self, now: float) -> tuple[Position, float]:
        """Where the main thread stands, and how long it has waited in that same collective."""
        pos = position_of(self._main, self.names)
        if not pos.collective or pos.key != self._key:
            self._key, self._since, self._pending = pos.key, now, None
        return pos, (now - self._since if pos.collective else 0.0)

    def _tick(self) -> None:
        now = time.monotonic()
        pos, waited = self._where(now)
        self._publish(pos, waited)
        if self._peers is None and self._count > 2:  # once: where every rank runs, should the store go silent
            records = self._records()
            self._peers = records if len(records) == self.world else None
        if self._store.check(["abort"]):
            self._abort_from_peer(pos, waited)
        elif waited >= self.threshold:
            self._investigate(pos, waited, now)

    def _publish(self, pos: Position, waited: float = 0.0) -> None:
        self._count += 1
        record = {"rank": self.rank, "beat": self._count, "step": self.step, "where": pos.describe(),
                  "in": bool(pos.collective), "waited": round(waited, 1), "pid": os.getpid(),
                  "host": socket.gethostname()}
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
        # the stopped ranks' records go with the abort: a live rank on their host kills them (a real multi-node job)
        self._store.set("abort", json.dumps({"by": self.rank, "missing": missing,
                                             "stopped": [second.get(r, first.get(r)) for r in stopped]}))
        self._say(line)
        # Stay two beats so that live peers read "abort" and print their own line before the launcher, seeing this
        # rank exit, signals them.
        time.sleep(2 * self.beat)
        for peer in stopped:
            _kill_if_local(second.get(peer, first.get(peer)))
        self._finish(line, printed=True)

    def _store_unreachable(self, err: Exception, since: float | None = None) -> None:
        """The store stopped answering. Under a launcher that serves it from rank 0's process (several nodes, each
        attempt a fresh store), a stopped or dead rank 0 takes the store with it, and no heartbeat can be read: once
        this rank has also waited in one collective for the threshold, report that and end the process."""
        now = time.monotonic()
        if self._store_down_since is None:
            self._store_down_since = now if since is None else since
        pos, waited = self._where(now)
        down = now - self._store_down_since
        if not pos.collective or waited < self.threshold or down < _INVESTIGATE_BEATS * self.beat:
            return
        line = (f"[nd_parallel] hang: rank {self.rank} at step {self.step} waits {pos.describe()} for {waited:.0f} s "
                f"(hang_timeout={self.timeout:.0f}s); missing: every heartbeat, the store has not answered for "
                f"{down:.0f} s ({type(err).__name__}): its host (rank 0, or torchrun's agent on the first node) is "
                "stopped or dead")
        self._say(line)
        if self.rank != 0:  # a stopped rank 0 runs no SIGTERM handler: its agent would wait 30 s for it
            _kill_if_local((self._peers or {}).get(0))
        self._finish(line, printed=True)

    def _abort_from_peer(self, pos: Position, waited: float) -> None:
        info = json.loads(self._store.get("abort"))
        if info["by"] == self.rank:
            return
        held = f" for {waited:.0f} s" if pos.collective else ""
        line = (f"[nd_parallel] hang reported by rank {info['by']}: rank {self.rank} at step {self.step} stands "
                f"{pos.describe()}{held}; missing: {'; '.join(info['missing']) or 'none'}")
        self._say(line)
        for record in info.get("stopped", []):
            _kill_if_local(record)
        self._finish(line, printed=True)

    def _say(self, line: str) -> None:
        self.report = line
        _write_line(line)
        if self.on_report is not None:
            self.on_report(line)

    def _finish(self, line: str, printed: bool = False) -> None:
        if self._closed:
            return
        if not printed:
            self._say(line)
        self._stop.set()
        self._exit(1)


def _missing(me: int, pos: Position, first: dict, second: dict, span: float) -> tuple[list[str], list[int]]:
    """Describe every rank of the group this rank waits on that is not waiting in the same place, and every other
    rank that stopped beating: with nested groups the peer this rank waits for may itself wait for a stopped rank
    outside this group (HSDP: dp_replicate peers wait in dp_shard for the stopped one), the root of the hang."""
    everyone = sorted(set(first) | set(second))
    group = [r for r in (pos.ranks or everyone) if r != me]
    peers = group + [r for r in everyone if r != me and r not in group]
    stopped = [r for r in peers if r in first and r in second and first[r]["beat"] == second[r]["beat"]]
    # a peer waiting in another collective: with a rank stopped it may be waiting on that one (nested groups)
    elsewhere = ("perhaps on a stopped rank, or a collective only some ranks call" if stopped else
                 "a collective only some ranks call")
    missing = []
    for r in peers:
        b = second.get(r)
        if r in stopped:
            missing.append(f"rank {r} (no heartbeat over the last {span:.1f} s: stopped or dead; its last one was "
                           f"at step {b['step']}, {b['where']})")
        elif r not in group:
            continue
        elif b is None:
            missing.append(f"rank {r} (never started hang detection)")
        elif not b["in"]:
            missing.append(f"rank {r} (alive, step {b['step']}, {b['where']}: busy, e.g. an endless loop)")
        elif b["where"] != pos.describe():
            missing.append(f"rank {r} (step {b['step']}, waits {b['where']}: {elsewhere})")
    return missing, stopped


def _kill_if_local(record: dict | None) -> None:
    """SIGKILL a stopped rank on this host: SIGSTOP'd, it would never run a SIGTERM handler nor exit by itself.
    The line it prints tells this kill apart from a launcher's own escalation (torchrun SIGKILLs a rank that
    ignored its SIGTERM for 30 s, and reports both the same way)."""
    if record and record.get("host") == socket.gethostname():
        try:
            os.kill(int(record["pid"]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        _write_line(f"[nd_parallel] hang: sent SIGKILL to stopped rank {record.get('rank', '?')} (pid {record['pid']} "
                    f"on {record['host']}): a stopped process runs no handler")


def _write_line(line: str) -> None:
    """One write of the line and its newline. print() writes them apart, and with unbuffered stderr two ranks
    reporting at once then interleave on the launcher's shared output (one report glued to the next)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class _Beat(threading.Thread):
    """One beat of the watchdog (``Watchdog._tick``), remembering when it started and what it raised."""

    def __init__(self, tick):
        super().__init__(name="nd_parallel-watchdog-beat", daemon=True)
        self._tick, self.started, self.error = tick, time.monotonic(), None

    def run(self) -> None:
        try:
            self._tick()
        except Exception as err:
            self.error = err


def _store_timeout(beat: float) -> float:
    return max(10.0, 4 * beat)


def _own_store(beat: float):
    """A second connection to the default store, with a short timeout, used by the watchdog thread only."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store().clone()
    store.set_timeout(timedelta(seconds=_store_timeout(beat)))
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
