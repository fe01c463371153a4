"""A real 1F1B run on 4 pipeline ranks (8 micro-batches, 4 layers) draws the textbook staircase.

The timeline is recorded by wrapping the torch.distributed.pipelining stages (nd_parallel.distributed.pipeline.timeline);
the assertions are about the order of events, which holds on any machine, not about their durations.
"""

import json
import time
from collections import defaultdict

import pytest

from nd_parallel.fault.launch import launch

P, M = 4, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_timeline")
    start = time.time()
    launch("tests/distributed/pp_timeline_worker.py", P, [str(out)], timeout=180, capture=True)
    data = json.loads((out / "events.json").read_text())
    return out, data["events"], data["summary"], time.time() - start


def by_rank(events):
    rows = defaultdict(list)
    for e in sorted(events, key=lambda e: e["start"]):
        rows[e["rank"]].append(e)
    return rows


def test_every_rank_runs_m_forwards_and_m_backwards(run):
    _, events, _, _ = run
    rows = by_rank(events)
    assert sorted(rows) == list(range(P))
    for rank, row in rows.items():
        assert sorted(e["mb"] for e in row if e["kind"] == "F") == list(range(M)), rank
        assert sorted(e["mb"] for e in row if e["kind"] == "B") == list(range(M)), rank
        assert not [e for e in row if e["kind"] == "W"]  # 1F1B runs full backwards
        assert {e["stage"] for e in row} == {rank}


def test_forward_staircase_and_backward_staircase(run):
    _, events, _, _ = run
    first = {(e["rank"], e["kind"]): e for e in sorted(events, key=lambda e: -e["start"])}  # earliest wins
    for r in range(1, P):
        # rank r can only start micro-batch 0 once rank r-1 has sent it...
        assert first[r, "F"]["start"] >= first[r - 1, "F"]["end"], (r, first[r, "F"], first[r - 1, "F"])
        # ...and the gradient travels back the other way.
        assert first[r - 1, "B"]["start"] >= first[r, "B"]["end"], (r, first[r - 1, "B"], first[r, "B"])


def test_forward_of_each_microbatch_precedes_its_backward(run):
    _, events, _, _ = run
    for rank, row in by_rank(events).items():
        f = {e["mb"]: e for e in row if e["kind"] == "F"}
        b = {e["mb"]: e for e in row if e["kind"] == "B"}
        assert all(f[i]["end"] <= b[i]["start"] for i in range(M)), rank
    for i in range(M):  # and across ranks: the last stage's backward of i after every forward of i
        last_b = next(e for e in events if e["rank"] == P - 1 and e["kind"] == "B" and e["mb"] == i)
        assert all(e["end"] <= last_b["start"] for e in events if e["kind"] == "F" and e["mb"] == i)


def test_steady_state_alternates_one_forward_one_backward(run):
    _, events, _, _ = run
    for rank, row in by_rank(events).items():
        kinds = "".join(e["kind"] for e in row)
        warmup = min(M, P - rank)  # torch's 1F1B: P - rank forwards, then B F pairs, then the drain
        assert kinds == "F" * warmup + "BF" * (M - warmup) + "B" * warmup, (rank, kinds)
        assert [e["mb"] for e in row if e["kind"] == "B"] == list(range(M))  # backwards in order


def test_replayed_recorded_order_has_the_textbook_bubble(run):
    """The order torch ran, re-timed with equal stage times and instant messages, is exactly 1F1B's bubble."""
    from nd_parallel.distributed.pipeline.timeline.analysis import analytical_bubble, bubble, replay
    from nd_parallel.distributed.pipeline.timeline.events import Event

    _, events, _, _ = run
    recorded = [Event(**e) for e in events]
    out = replay(recorded, lambda e: 1.0 if e.kind == "F" else 2.0)
    assert bubble(out, P).mean == pytest.approx(analytical_bubble("1f1b", P, M))


def test_outputs_and_bubble(run):
    out, _, summary, seconds = run
    trace = json.loads((out / "timeline.json").read_text())
    names = {t["name"] for t in trace["traceEvents"] if t["ph"] == "X"}
    assert names == {f"{k}{i}" for k in "FB" for i in range(M)}
    assert summary["bubble_analytical"] == pytest.approx((P - 1) / (M + P - 1))
    assert 0.0 < summary["bubble_mean"] < 1.0 and len(summary["bubble_per_rank"]) == P
    print(f"1F1B p={P} m={M}: measured bubble {summary['bubble_mean']:.3f} "
          f"(per rank {summary['bubble_per_rank']}), analytical {summary['bubble_analytical']:.3f}; "
          f"launch {seconds:.1f}s")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:  # the picture is optional (pip install .[bench])
        assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_profile_balance_agrees_and_stages_are_timed(run):
    out, _, _, _ = run
    data = json.loads((out / "balance.json").read_text())
    assert len(data["counts"]) == P and sum(data["counts"]) == 4  # identical on every rank (checked in the run)
    assert len(data["stage_seconds"]) == P and all(t > 0 for t in data["stage_seconds"])
