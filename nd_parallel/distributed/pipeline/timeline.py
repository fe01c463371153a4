"""What a pipeline schedule really did: per-rank, per-micro-batch F / B / W intervals of real steps.

``TimelineRecorder`` wraps three methods on each ``torch.distributed.pipelining`` stage instance it is
given — ``forward_one_chunk`` (F), ``backward_one_chunk`` (B: full backward, or the input-gradient half
under a zero-bubble schedule) and ``backward_weight_one_chunk`` (W) — and records (stage, micro-batch,
kind, start, end) with ``time.perf_counter``. Waiting for a peer happens outside those methods, in the
schedule, so the gaps between intervals are the bubble. The last stage's loss, computed by the schedule
right after F, is folded into that F.

Ranks' clocks are aligned once, NTP-style: the first rank of the group pings every other rank and keeps,
per rank, the offset measured in the round trip with the smallest delay (error <= half that delay, tens of
microseconds on one host). After gathering, times are seconds since the first F of the step.

The rest of the module is pure (no process group): bubble fractions, the analytical bubble of each
schedule, a Chrome trace (open in https://ui.perfetto.dev) and the textbook pipeline picture (matplotlib).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

KINDS = ("F", "B", "W")
_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


@dataclass(frozen=True)
class Event:
    rank: int  # rank in the pp group
    stage: int  # global stage index
    mb: int  # micro-batch index
    kind: str  # "F", "B" or "W"
    start: float  # seconds
    end: float

    @property
    def name(self) -> str:
        return f"{self.kind}{self.mb}"


# ------------------------------------------------------------------------------------------ recording
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
    def _clock_offsets(self, rounds: int = 8) -> list[float]:
        """Per rank: its clock minus the first rank's clock (known on the first rank; zeros elsewhere)."""
        me, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        offsets = [0.0] * size
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
                elif me == peer:
                    dist.recv(buf, group=self.group, group_src=0)
                    buf.fill_(self.clock())
                    dist.send(buf, group=self.group, group_dst=0)
        return offsets

    def gather(self, step: int = -1) -> list[Event] | None:
        """Collective over the group: every rank's events of kept step ``step`` (-1: the last) on the first rank."""
        if self._offsets is None:
            self._offsets = self._clock_offsets()
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


def compare_stage_times(predicted: list[float], measured: dict[int, float]) -> str:
    """One line: predicted vs measured per-stage time, absolute and relative to the mean stage.

    The profile used a sample shape, the run its real micro-batch: absolute times differ by that ratio,
    the relative ones (what decides the split) should not.
    """
    meas = [measured.get(i, 0.0) for i in range(len(predicted))]
    rel = lambda xs: ", ".join(f"{x / (sum(xs) / len(xs)):.2f}" for x in xs)  # noqa: E731
    ms = lambda xs: ", ".join(f"{1e3 * x:.2f}" for x in xs)  # noqa: E731
    return (f"per-stage fwd+bwd per micro-batch: predicted [{ms(predicted)}] ms, measured [{ms(meas)}] ms; "
            f"relative to the mean stage: predicted [{rel(predicted)}], measured [{rel(meas)}]")


# --------------------------------------------------------------------------------------------- analysis
@dataclass(frozen=True)
class Bubble:
    span: float  # seconds from the first start to the last end, over all ranks
    per_rank: dict[int, float]  # idle fraction of the span, per rank
    busy: dict[int, float]  # seconds of work per rank

    @property
    def mean(self) -> float:
        return sum(self.per_rank.values()) / len(self.per_rank)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def bubble(events: list[Event], ranks: int | None = None) -> Bubble:
    """Idle time inside the step span over the span, per rank (a rank without events is idle throughout)."""
    if not events:
        raise ValueError("no events: was the recorder attached, and did a step run?")
    span = max(e.end for e in events) - min(e.start for e in events)
    by_rank: dict[int, list] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append((e.start, e.end))
    ranks = ranks if ranks is not None else max(by_rank) + 1
    busy = {r: _union_length(by_rank.get(r, [])) for r in range(ranks)}
    return Bubble(span, {r: 1.0 - b / span for r, b in busy.items()}, busy)


def analytical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float | None:
    """Textbook bubble fraction with equal stage times; None for zero-bubble schedules (see ``BUBBLE_NOTE``)."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)  # each warm-up/drain slot is 1/v of a rank's work per micro-batch
    return None


BUBBLE_NOTE = ("gpipe/1f1b: (p-1)/(m+p-1); interleaved-1f1b: (p-1)/(v*m+p-1); zero-bubble schedules (interleaved-zb, "
               "zbv) have no single formula: W (weight gradients) fills the drain and the bubble tends to 0 as m grows "
               "when t_F ~ t_B ~ t_W; replay() of the recorded order gives the exact value for given stage times")


def replay(events: list[Event], duration) -> list[Event]:
    """Re-time the recorded action order with ``duration(event)`` seconds each and instant communication.

    Each rank keeps the order it ran its actions in; an action starts when its rank is free and its inputs
    exist: F(s, i) after F(s-1, i); B(s, i) after F(s, i) and B(s+1, i); W(s, i) after B(s, i). The result
    is the bubble the *schedule* implies for those compute times, free of launch jitter, communication
    latency and other load on the machine — with equal stage times, the textbook formulas.
    """
    order: dict[int, list[Event]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e.start):
        order[e.rank].append(e)
    last_stage = max(e.stage for e in events)
    done: dict[tuple, float] = {}
    out: list[Event] = []
    pos = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    while len(out) < len(events):
        progressed = False
        for rank, row in order.items():
            while pos[rank] < len(row):
                e = row[pos[rank]]
                deps = {"F": [("F", e.stage - 1)] if e.stage > 0 else [],
                        "B": [("F", e.stage)] + ([("B", e.stage + 1)] if e.stage < last_stage else []),
                        "W": [("B", e.stage)]}[e.kind]
                keys = [(k, s, e.mb) for k, s in deps]
                if any(k not in done for k in keys):
                    break  # waits for another rank
                start = max([free[rank]] + [done[k] for k in keys])
                end = start + duration(e)
                done[(e.kind, e.stage, e.mb)] = end
                free[rank] = end
                out.append(Event(e.rank, e.stage, e.mb, e.kind, start, end))
                pos[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("the recorded order has a cycle or a missing dependency; cannot replay it")
    return sorted(out, key=lambda e: (e.rank, e.start))


def median_durations(events: list[Event]):
    """``duration`` for ``replay``: the measured median of each (stage, kind)."""
    by: dict[tuple, list[float]] = defaultdict(list)
    for e in events:
        by[(e.stage, e.kind)].append(e.end - e.start)
    med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
    return lambda e: med[(e.stage, e.kind)]


def stage_seconds(events: list[Event]) -> dict[int, float]:
    """Work per micro-batch of each stage (F + B + W), averaged over the micro-batches it ran."""
    total: dict[int, float] = defaultdict(float)
    mbs: dict[int, set] = defaultdict(set)
    for e in events:
        total[e.stage] += e.end - e.start
        mbs[e.stage].add(e.mb)
    return {s: total[s] / len(mbs[s]) for s in sorted(total)}


def summarize(events: list[Event], schedule: str, p: int, m: int, v: int = 1) -> dict:
    b = bubble(events, p)
    return {
        "schedule": schedule, "pp_size": p, "microbatches": m, "virtual_stages": v,
        "span_ms": 1e3 * b.span,
        "bubble_per_rank": {str(r): round(f, 4) for r, f in b.per_rank.items()},
        "bubble_mean": round(b.mean, 4),
        "bubble_analytical": analytical_bubble(schedule, p, m, v),
        "note": BUBBLE_NOTE,
    }


# ---------------------------------------------------------------------------------------------- output
def chrome_trace(events: list[Event], summary: dict | None = None) -> dict:
    """Chrome trace-event JSON: one process per pp rank, one slice per event ("F3", "B3", "W3")."""
    trace = []
    for rank in sorted({e.rank for e in events}):
        stages = sorted({e.stage for e in events if e.rank == rank})
        trace += [
            {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"pp rank {rank}"}},
            {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}},
            {"ph": "M", "pid": rank, "tid": 0, "name": "thread_name",
             "args": {"name": "stage " + ",".join(map(str, stages))}},
        ]
    for e in events:
        trace.append({"ph": "X", "pid": e.rank, "tid": 0, "name": e.name, "cat": e.kind,
                      "ts": round(1e6 * e.start, 3), "dur": round(1e6 * (e.end - e.start), 3),
                      "args": {"stage": e.stage, "microbatch": e.mb}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": summary or {}}


_COLORS = {"F": "#4c78a8", "B": "#59a14f", "W": "#f28e2b"}


def _shade(hex_color: str, chunk: int) -> tuple:
    """Later virtual chunks of a rank in a lighter shade of the same colour."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = min(0.45 * chunk, 0.7)
    return tuple(c + (1 - c) * mix for c in rgb)


def plot(events: list[Event], path: str | Path, *, p: int, title: str = "", bubble_note: str = "") -> None:
    """The textbook pipeline picture: one row per rank, a box per F/B/W with its micro-batch number."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("the timeline picture needs matplotlib: pip install 'nd_parallel[bench]'") from e
    b = bubble(events, p)
    end_ms = 1e3 * b.span
    fig, ax = plt.subplots(figsize=(14, 0.62 * p + 1.6), dpi=120)
    for e in events:
        x, w = 1e3 * e.start, 1e3 * (e.end - e.start)
        color = _shade(_COLORS[e.kind], e.stage // p)
        ax.broken_barh([(x, w)], (e.rank - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.6)
        label = str(e.mb)
        if w > end_ms * 0.011 * len(label):  # leave the number out of boxes too narrow to hold it
            ax.text(x + w / 2, e.rank, label, ha="center", va="center", fontsize=8, fontweight="bold",
                    color="white" if e.stage < p else "#222222")
    for rank, frac in b.per_rank.items():
        ax.text(end_ms * 1.005, rank, f"idle {100 * frac:.0f}%", va="center", fontsize=8, color="#555555")
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_xlim(0, end_ms * 1.07)
    ax.set_xlabel("time since the first forward (ms)")
    ax.set_facecolor("#f4f4f4")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in KINDS if any(e.kind == k for e in events)]
    names = {"F": "F forward", "B": "B backward", "W": "W weight grad"}
    handles = [Patch(color=_COLORS[k], label=names[k]) for k in kinds]
    if any(e.stage >= p for e in events):
        handles.append(Patch(color=_shade("#888888", 1), label="lighter: the rank's later stage"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 1.0 + 0.9 / (p + 2)), ncol=len(handles),
              frameon=False, fontsize=9)
    if title or bubble_note:
        ax.set_title("\n".join(t for t in (title, bubble_note) if t), fontsize=10, loc="right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(events: list[Event], out_dir: str | Path, *, schedule: str, p: int, m: int, v: int = 1,
          name: str = "timeline", png: bool = True) -> dict:
    """Write ``name``.json (Chrome trace) and, with matplotlib, ``name``.png; return the bubble summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(events, schedule, p, m, v)
    (out / f"{name}.json").write_text(json.dumps(chrome_trace(events, summary)))
    analytic = summary["bubble_analytical"]
    note = (f"measured bubble {100 * summary['bubble_mean']:.1f}% (mean over ranks), analytical "
            + (f"{100 * analytic:.1f}%" if analytic is not None else "~0 (zero-bubble)"))
    if png:
        try:
            plot(events, out / f"{name}.png", p=p, title=f"{schedule}: p={p}, m={m}, v={v}", bubble_note=note)
        except ImportError as e:
            logger.warning("%s; wrote only %s.json", e, name)
    per_stage = ", ".join(f"{1e3 * t:.2f}" for t in stage_seconds(events).values())
    logger.info("pipeline timeline written to %s.json/.png: %s; per-stage F+B+W per micro-batch [%s] ms",
                out / name, note, per_stage)
    return summary


def events_from_trace(trace: dict) -> list[Event]:
    """Read events back from a Chrome trace written by ``chrome_trace``."""
    return [Event(t["pid"], t["args"]["stage"], t["args"]["microbatch"], t["cat"], t["ts"] / 1e6,
                  (t["ts"] + t["dur"]) / 1e6) for t in trace["traceEvents"] if t["ph"] == "X"]


def to_dicts(events: list[Event]) -> list[dict]:
    return [asdict(e) for e in events]
