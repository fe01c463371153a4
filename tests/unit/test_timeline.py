"""Unit tests for nd_parallel.distributed.pipeline.timeline: recording, bubble math, trace JSON, picture."""

from __future__ import annotations

import json

import pytest

from nd_parallel.distributed.pipeline.timeline.analysis import (
    analytical_bubble,
    bubble,
    compare_stage_times,
    median_durations,
    replay,
    stage_seconds,
    summarize,
)
from nd_parallel.distributed.pipeline.timeline.events import Event
from nd_parallel.distributed.pipeline.timeline.record import TimelineRecorder, align
from nd_parallel.distributed.pipeline.timeline.render import chrome_trace, events_from_trace, write


def gpipe_events(p: int, m: int, tf: float, tb: float) -> list[Event]:
    """The ideal GPipe timeline with equal stage times: all forwards, then all backwards in reverse."""
    events = []
    for r in range(p):
        for i in range(m):
            events.append(Event(r, r, i, "F", (r + i) * tf, (r + i + 1) * tf))
            start = (m + p - 1) * tf + (p - 1 - r + i) * tb
            events.append(Event(r, r, i, "B", start, start + tb))
    return events


@pytest.mark.parametrize("p, m", [(4, 4), (4, 8), (2, 1), (8, 3)])
def test_bubble_of_ideal_gpipe_is_the_textbook_formula(p, m):
    b = bubble(gpipe_events(p, m, tf=1.0, tb=2.0), p)
    assert b.span == pytest.approx((m + p - 1) * 3.0)
    assert all(f == pytest.approx((p - 1) / (m + p - 1)) for f in b.per_rank.values())
    assert b.mean == pytest.approx(analytical_bubble("gpipe", p, m))


def test_bubble_counts_overlaps_once_and_idle_ranks_fully():
    events = [Event(0, 0, 0, "F", 0.0, 2.0), Event(0, 0, 1, "F", 1.0, 3.0), Event(0, 0, 0, "B", 5.0, 6.0),
              Event(1, 1, 0, "F", 3.0, 4.0)]
    b = bubble(events, ranks=3)
    assert b.span == 6.0
    assert b.busy == {0: 4.0, 1: 1.0, 2: 0.0}
    assert b.per_rank[0] == pytest.approx(1 / 3) and b.per_rank[2] == 1.0
    with pytest.raises(ValueError, match="no events"):
        bubble([])


def test_analytical_bubbles():
    assert analytical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert analytical_bubble("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert analytical_bubble("interleaved-1f1b", 4, 8, v=2) == pytest.approx(3 / 19)
    assert analytical_bubble("zbv", 4, 8, v=2) is None and analytical_bubble("interleaved-zb", 4, 8, 2) is None


def one_f_one_b_order(p: int, m: int) -> list[Event]:
    """torch's 1F1B action order per rank (P - r forwards, B F pairs, the drain), with meaningless times."""
    events = []
    for r in range(p):
        w, f, b = min(m, p - r), 0, 0
        for t, kind in enumerate("F" * w + "BF" * (m - w) + "B" * w):
            events.append(Event(r, r, f if kind == "F" else b, kind, 10.0 * t, 10.0 * t + 1))
            f, b = (f + 1, b) if kind == "F" else (f, b + 1)
    return events


@pytest.mark.parametrize("p, m", [(4, 4), (4, 8), (2, 5), (8, 16)])
def test_replay_of_1f1b_order_gives_the_textbook_bubble(p, m):
    out = replay(one_f_one_b_order(p, m), lambda e: 1.0 if e.kind == "F" else 2.0)
    b = bubble(out, p)
    assert b.span == pytest.approx((m + p - 1) * 3.0)
    assert b.mean == pytest.approx(analytical_bubble("1f1b", p, m))


def test_replay_removes_jitter_and_keeps_dependencies():
    ideal = gpipe_events(4, 4, 1.0, 2.0)
    # the same order, but every event delayed by a different amount (a noisy machine)
    noisy = [Event(e.rank, e.stage, e.mb, e.kind, e.start * 1.5 + 0.1 * e.mb, e.end * 1.5 + 0.1 * e.mb + 0.3)
             for e in ideal]
    assert bubble(noisy, 4).mean != pytest.approx(3 / 7)
    out = replay(noisy, lambda e: 1.0 if e.kind == "F" else 2.0)
    assert sorted((e.rank, e.name, e.start, e.end) for e in out) == sorted(
        (e.rank, e.name, e.start, e.end) for e in ideal)
    med = median_durations(ideal)
    assert med(ideal[0]) == 1.0 and med(Event(0, 0, 0, "B", 0, 0)) == 2.0
    w = [Event(0, 0, 0, "F", 0, 1), Event(0, 0, 0, "W", 1, 2), Event(0, 0, 0, "B", 2, 3)]  # W before its B
    with pytest.raises(ValueError, match="cannot replay"):
        replay(w, lambda e: 1.0)


def test_chrome_trace_structure_and_round_trip():
    events = gpipe_events(2, 2, 0.001, 0.002) + [Event(1, 1, 0, "W", 0.01, 0.011)]
    trace = chrome_trace(events, {"bubble_mean": 0.3})
    json.dumps(trace)  # serialisable
    slices = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    meta = [t for t in trace["traceEvents"] if t["ph"] == "M"]
    assert len(slices) == len(events)
    assert {t["name"] for t in slices} >= {"F0", "F1", "B0", "B1", "W0"}
    assert {t["pid"] for t in slices} == {0, 1} and {t["tid"] for t in slices} == {0}
    names = {t["pid"]: t["args"]["name"] for t in meta if t["name"] == "process_name"}
    assert names == {0: "pp rank 0", 1: "pp rank 1"}
    first = next(t for t in slices if t["name"] == "F1" and t["pid"] == 1)
    assert first["ts"] == pytest.approx(2000.0) and first["dur"] == pytest.approx(1000.0)  # microseconds
    assert first["args"] == {"stage": 1, "microbatch": 1} and first["cat"] == "F"
    assert trace["otherData"] == {"bubble_mean": 0.3} and trace["displayTimeUnit"] == "ms"
    back = events_from_trace(trace)
    assert sorted((e.rank, e.name) for e in back) == sorted((e.rank, e.name) for e in events)


def test_align_applies_offsets_and_origin():
    per_rank = [[(0, 0, "F", 10.0, 11.0)], [(1, 0, "F", 111.5, 112.0)]]  # rank 1's clock runs 100 s ahead
    events = align(per_rank, [0.0, 100.0])
    assert [(e.rank, e.start, e.end) for e in events] == [(0, 0.0, 1.0), (1, 1.5, 2.0)]


def test_stage_seconds_and_comparison():
    events = gpipe_events(2, 4, 1.0, 2.0) + [Event(1, 1, 0, "W", 20.0, 21.0)]
    assert stage_seconds(events) == {0: 3.0, 1: 3.25}
    line = compare_stage_times([0.003, 0.003], {0: 0.003, 1: 0.0033})
    assert "predicted [3.00, 3.00] ms" in line and "measured [1.00, 1.00]" not in line


def test_summary_and_files(tmp_path):
    events = gpipe_events(4, 8, 0.001, 0.002)
    s = summarize(events, "gpipe", 4, 8)
    assert s["bubble_mean"] == pytest.approx(3 / 11, abs=1e-4) and s["bubble_analytical"] == pytest.approx(3 / 11)
    summary = write(events, tmp_path, schedule="gpipe", p=4, m=8, png=False)
    trace = json.loads((tmp_path / "timeline.json").read_text())
    assert trace["otherData"]["bubble_mean"] == summary["bubble_mean"]


def test_png_picture(tmp_path):
    pytest.importorskip("matplotlib")
    write(gpipe_events(4, 8, 0.001, 0.002), tmp_path, schedule="gpipe", p=4, m=8)
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ recorder
class FakeStage:
    def __init__(self, index, is_last):
        self.stage_index, self.is_last, self.has_backward = index, is_last, True
        self.calls = []

    def forward_one_chunk(self, chunk, args, kwargs=None, save_forward_output=True):
        self.calls.append(("F", chunk))
        return chunk

    def backward_one_chunk(self, chunk, loss=None, full_backward=True, last_backward=False):
        self.calls.append(("B", chunk, full_backward))

    def backward_weight_one_chunk(self, chunk, last_backward=False):
        self.calls.append(("W", chunk))


class FakeSchedule:
    def __init__(self, stages):
        self._stages = stages

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        self.loss_stage = stage.stage_index


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_recorder_wraps_stage_methods_and_folds_the_loss_into_f(one_rank_group):
    first, last = FakeStage(0, False), FakeStage(1, True)
    schedule = FakeSchedule([first, last])
    rec = TimelineRecorder(None, clock=Clock())
    rec.instrument(schedule)
    rec.instrument(schedule)  # idempotent: no double wrapping
    first.forward_one_chunk(0, (), {})  # outside a step: not recorded
    with rec.step():
        assert last.forward_one_chunk(3, (), {}) == 3  # clock 1 -> 2
        schedule._maybe_compute_loss(last, None, None, 3)  # clock 3: extends F3
        last.backward_one_chunk(3, loss=None, full_backward=False)  # 4 -> 5
        last.backward_weight_one_chunk(3)  # 6 -> 7
        first.has_backward = False
        first.backward_one_chunk(3)  # eval mode: no B recorded
    assert schedule.loss_stage == 1 and last.calls == [("F", 3), ("B", 3, False), ("W", 3)]
    assert list(rec.steps) == [[(1, 3, "F", 1.0, 3.0), (1, 3, "B", 4.0, 5.0), (1, 3, "W", 6.0, 7.0)]]
    events = rec.gather()
    assert [(e.name, e.start, e.end) for e in events] == [("F3", 0.0, 2.0), ("B3", 3.0, 4.0), ("W3", 5.0, 6.0)]


def test_recorder_keeps_the_last_steps_and_can_be_switched_off():
    stage = FakeStage(0, True)
    rec = TimelineRecorder(None, clock=Clock(), keep=2)
    rec.instrument(FakeSchedule([stage]))
    for mb in range(3):
        with rec.step():
            stage.forward_one_chunk(mb, ())
    assert rec.count == 3 and [row[0][1] for row in rec.steps] == [1, 2]
    rec.enabled = False
    with rec.step():
        stage.forward_one_chunk(7, ())
    assert rec.count == 3 and len(stage.calls) == 4  # still runs, no longer recorded


def test_instrument_refuses_unknown_schedules():
    with pytest.raises(TypeError, match="_stage"):
        TimelineRecorder(None).instrument(object())
