"""What a recorded timeline says (pure: no process group): bubbles, stage times, and a replay.

Kept apart from recording so that it runs on events from anywhere (a gathered step, a saved trace, a
synthetic schedule in a test), and from rendering so that the numbers need no plotting library.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .events import Event


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


def _waits_for(e: Event, last_stage: int) -> list[tuple[str, int, int]]:
    """The (kind, stage, micro-batch) actions ``e`` needs done first."""
    deps = {"F": [("F", e.stage - 1)] if e.stage > 0 else [],
            "B": [("F", e.stage)] + ([("B", e.stage + 1)] if e.stage < last_stage else []),
            "W": [("B", e.stage)]}[e.kind]
    return [(k, s, e.mb) for k, s in deps]


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
                keys = _waits_for(e, last_stage)
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
