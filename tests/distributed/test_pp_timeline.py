"""A real 1F1B run on 4 pipeline ranks (8 micro-batches, 4 layers) draws the textbook staircase.

The timeline is recorded by wrapping the torch.distributed.pipelining stages (nd_parallel.distributed.pipeline.timeline);
the assertions are about the order of events, which holds on any machine, not about their durations. Two ranks'
times are on rank 0's clock, each within the error bound its alignment measured (``alignment_error``, record.py):
an order across ranks is asserted up to the sum of the two bounds.
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


@pytest.fixture(scope="module")
def clock_error(run):
    """Per rank: seconds its aligned times may be off rank 0's clock (half its fastest ping round trip)."""
    out, *_ = run
    error = json.loads((out / "events.json").read_text())["alignment_error"]
    assert len(error) == P and error[0] == 0.0 and all(0.0 <= e < float("inf") for e in error), error
    return error


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


def test_forward_staircase_and_backward_staircase(run, clock_error):
    """What 1F1B guarantees across ranks, for every micro-batch i: stage r starts F(i) only once stage r-1's F(i)
    has returned (the schedule posts the send after forward_one_chunk returns, the recorder stamps the end as it
    returns, and the receiver stamps its start after its receive completed), and the gradient travels back the
    other way: stage r-1 starts B(i) only once stage r's B(i) has returned."""
    _, events, _, _ = run
    at = {(e["rank"], e["kind"], e["mb"]): e for e in events}
    print(f"clock alignment error per rank: {[f'{e * 1e6:.0f} us' for e in clock_error]}")
    for i in range(M):
        for r in range(1, P):
            slack = clock_error[r] + clock_error[r - 1]
            sent, got = at[r - 1, "F", i], at[r, "F", i]
            assert got["start"] >= sent["end"] - slack, ("F", i, r, sent, got, slack)
            sent, got = at[r, "B", i], at[r - 1, "B", i]
            assert got["start"] >= sent["end"] - slack, ("B", i, r, sent, got, slack)


def test_forward_of_each_microbatch_precedes_its_backward(run, clock_error):
    _, events, _, _ = run
    for rank, row in by_rank(events).items():  # one rank, one clock: exact
        f = {e["mb"]: e for e in row if e["kind"] == "F"}
        b = {e["mb"]: e for e in row if e["kind"] == "B"}
        assert all(f[i]["end"] <= b[i]["start"] for i in range(M)), rank
    for i in range(M):  # and across ranks: the last stage's backward of i after every forward of i
        last_b = next(e for e in events if e["rank"] == P - 1 and e["kind"] == "B" and e["mb"] == i)
        for e in events:
            if e["kind"] == "F" and e["mb"] == i:
                slack = clock_error[e["rank"]] + clock_error[P - 1]
                assert e["end"] <= last_b["start"] + slack, (i, e, last_b, slack)


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
