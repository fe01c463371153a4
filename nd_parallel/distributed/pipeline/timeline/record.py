"""Recording a live schedule: wrappers on the stages, clock alignment, gathering over the pp group.

``TimelineRecorder`` wraps three methods on each ``torch.distributed.pipelining`` stage instance it is
given — ``forward_one_chunk`` (F), ``backward_one_chunk`` (B: full backward, or the input-gradient half
under a zero-bubble schedule) and ``backward_weight_one_chunk`` (W) — and records (stage, micro-batch,
kind, start, end) with ``time.perf_counter``. Waiting for a peer happens outside those methods, in the
schedule, so the gaps between intervals are the bubble. The last stage's loss, computed by the schedule
right after F, is folded into that F.

Ranks' clocks are aligned once, NTP-style: the first rank of the group pings every other rank and keeps,
per rank, the offset measured in the round trip with the smallest delay (error <= half that delay, tens of
microseconds on one host; kept per rank in ``alignment_error``, so that whoever compares two ranks' times knows
how far apart they must be to be ordered). After gathering, times are seconds since the first F of the step.

The only part of the timeline that needs a process group, hence apart from the pure analysis and output.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from .analysis import compare_stage_times, stage_seconds
from .events import Event
from .render import write

logger = logging.getLogger(__name__)

_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


class TimelineRecorder:
    """Records F/B/W intervals of the stages it instruments, one list per step; gathers them over ``group``."""

    def __init__(self, group, clock=time.perf_counter, keep: int | None = None):
        self.group = group
        self.clock = clock
        self.steps: deque[list[tuple]] = deque(maxlen=keep)  # the last ``keep`` steps (all by default)
        self.count = 0  # steps recorded so far
        self.enabled = True
        self._current: list[tuple] | None = None
        self._instrumented: set[int] = set()
        self._offsets: list[float] | None = None
        # per rank of the group, seconds: how far its aligned times may be off the first rank's clock (0 for that
        # rank itself); set on the first rank by the first gather
        self.alignment_error: list[float] | None = None

    # -- hooks
    def instrument(self, schedule) -> None:
        """Wrap the stages of a ``torch.distributed.pipelining`` schedule (once per schedule object)."""
        if id(schedule) in self._instrumented:
            return
        self._instrumented.add(id(schedule))
        stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
        if any(s is None for s in stages):
            raise TypeError(f"{type(schedule).__name__} exposes no _stage/_stages; cannot record its timeline")
        for stage in stages:
            for method, kind in _METHODS.items():
                self._wrap_stage(stage, method, kind)
        self._wrap_loss(schedule)

    def _wrap_stage(self, stage, method: str, kind: str) -> None:
        original = getattr(stage, method)  # bound method; the wrapper shadows it on this instance only

        def timed(chunk_id, *args, **kwargs):
            if self._current is None:  # outside a recorded step
                return original(chunk_id, *args, **kwargs)
            start = self.clock()
            out = original(chunk_id, *args, **kwargs)
            if self._current is not None and (kind == "F" or stage.has_backward):
                self._current.append((stage.stage_index, int(chunk_id), kind, start, self.clock()))
            return out

        setattr(stage, method, timed)

    def _wrap_loss(self, schedule) -> None:
        original = getattr(schedule, "_maybe_compute_loss", None)
        if original is None:
            return

        def with_loss(stage, *args, **kwargs):
            out = original(stage, *args, **kwargs)
            events = self._current
            if events and stage.is_last and events[-1][0] == stage.stage_index and events[-1][2] == "F":
                events[-1] = (*events[-1][:4], self.clock())  # the loss belongs to the last stage's F
            return out

        schedule._maybe_compute_loss = with_loss

    @contextlib.contextmanager
    def step(self):
        """Record the intervals of one training step (nothing while ``enabled`` is False)."""
        if not self.enabled:
            yield
            return
        self._current = []
        try:
            yield
        finally:
            self.steps.append(self._current)
            self.count += 1
            self._current = None

    # -- collectives over the pp group
    def _clock_offsets(self, rounds: int = 8) -> tuple[list[float], list[float]]:
        """Per rank: its clock minus the first rank's clock, and the bound on that estimate's error (half the
        fastest round trip: the peer read its clock somewhere inside it). Known on the first rank; zeros
        elsewhere."""
        me, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        offsets, errors = [0.0] * size, [0.0] * size
        buf = torch.zeros(1, dtype=torch.float64)
        for peer in range(1, size):
            best_delay = float("inf")
            for _ in range(rounds):
                if me == 0:
                    sent = self.clock()
                    dist.send(buf, group=self.group, group_dst=peer)
                    dist.recv(buf, group=self.group, group_src=peer)
                    back = self.clock()
                    if back - sent < best_delay:  # the fastest round trip bounds the error best
                        best_delay = back - sent
                        offsets[peer] = buf.item() - (sent + back) / 2
                        errors[peer] = best_delay / 2
                elif me == peer:
                    dist.recv(buf, group=self.group, group_src=0)
                    buf.fill_(self.clock())
                    dist.send(buf, group=self.group, group_dst=0)
        return offsets, errors

    def gather(self, step: int = -1) -> list[Event] | None:
        """Collective over the group: every rank's events of kept step ``step`` (-1: the last) on the first rank."""
        if self._offsets is None:
            self._offsets, self.alignment_error = self._clock_offsets()
        mine = self.steps[step] if self.steps else []
        me = dist.get_rank(self.group)
        table = [None] * dist.get_world_size(self.group) if me == 0 else None
        dist.gather_object(mine, table, group=self.group, group_dst=0)
        if me != 0:
            return None
        return align(table, self._offsets)


def align(per_rank: list[list[tuple]], offsets: list[float]) -> list[Event]:
    """Events on one clock (the first rank's), in seconds since the earliest start."""
    events = [Event(rank, s, mb, kind, t0 - offsets[rank], t1 - offsets[rank])
              for rank, rows in enumerate(per_rank) for s, mb, kind, t0, t1 in rows]
    origin = min((e.start for e in events), default=0.0)
    return sorted((Event(e.rank, e.stage, e.mb, e.kind, e.start - origin, e.end - origin) for e in events),
                  key=lambda e: (e.rank, e.start))


def attach(pipe, recorder: TimelineRecorder, out_dir: str | Path | None = None, write_at_step: int = 3,
           predicted: list[float] | None = None) -> TimelineRecorder:
    """Record every step of a built ``PipelineModel`` (instance-level wrappers; the class is untouched).

    With ``out_dir``, step number ``write_at_step`` (1-based; the first steps pay for start-up) is gathered
    and written as ``timeline.json`` / ``timeline.png`` by global rank 0, and its bubble is logged. With
    ``predicted`` (per-stage seconds from ``pp_balance="profile"``), the measured per-stage times are logged
    next to them.
    """
    if out_dir is not None and recorder.steps.maxlen is None:
        recorder.steps = deque(maxlen=1)  # only the step to write is needed
    build, run = pipe._schedule_for, pipe.forward
    p = pipe.mesh.size("pp")

    def schedule_for(shape):
        schedule = build(shape)
        recorder.instrument(schedule)
        return schedule

    def forward(*args, **kwargs):
        with recorder.step():
            out = run(*args, **kwargs)
        if out_dir is not None and recorder.enabled and recorder.count == write_at_step:
            recorder.enabled = False  # one step is the picture; stop paying for the wrappers' bookkeeping
            events = recorder.gather()  # collective over the pp group, same step on every pp rank
            if events is not None and dist.get_rank() == 0:
                write(events, out_dir, schedule=pipe.schedule_name, p=p, m=pipe.microbatches,
                      v=pipe.num_stages // p)
                if predicted is not None:
                    logger.info("%s", compare_stage_times(predicted, stage_seconds(events)))
        return out

    pipe._schedule_for = schedule_for
    pipe.forward = forward
    pipe.timeline = recorder
    return recorder
