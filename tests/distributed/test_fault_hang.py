"""Hang detection on 2 gloo ranks (FSDP2, hang_timeout=10 s): a stopped rank, a rank in an endless loop, a
collective only one rank calls. Every live rank must print its one-line report within hang_timeout of the fault
and every process must end non-zero (nd_parallel/fault/watchdog.py)."""

import json
import time
from pathlib import Path

import pytest

from nd_parallel.fault.launch import launch

HANG_TIMEOUT = 10


def events(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("events_*.jsonl")) for line in f.read_text().splitlines()]


def run_fault(mode: str, model: str, out: Path, **options) -> tuple[str, list[dict], float]:
    start = time.time()
    with pytest.raises(RuntimeError) as err:
        launch("tests/distributed/fault_worker.py", 2, [mode, model, str(out), json.dumps(options)], timeout=180,
               capture=True)
    return str(err.value), events(out), time.time() - start


@pytest.mark.parametrize("mode,reporters,culprit", [
    ("hang-stop", [0], "rank 1 (no heartbeat"),
    ("hang-loop", [0, 1], "rank 1 (alive, step 2"),
    ("hang-partial", [0, 1], "a collective only some ranks call"),
], ids=["sigstop", "endless-loop", "partial-collective"])
def test_hang_is_reported_by_every_live_rank(mode, reporters, culprit, tiny_models, tmp_path):
    text, evs, _ = run_fault(mode, tiny_models["llama"], tmp_path, hang_timeout=HANG_TIMEOUT)
    fault = min(e["t"] for e in evs if e["event"] == "fault")
    detected = {e["rank"]: e for e in evs if e["event"] == "detected"}
    assert sorted(detected) == reporters, text[-3000:]
    for rank, e in detected.items():
        took = e["t"] - fault
        print(f"{mode}: rank {rank} reported {took:.1f} s after the fault: {e['report']}")
        assert took <= HANG_TIMEOUT + 1.0, (took, e["report"])  # + 1 s: the beat and a loaded 2-core machine
        assert e["report"].count("\n") == 0 and "step 2" in e["report"] or "step 3" in e["report"]
        assert culprit in e["report"], e["report"]
    first = detected[min(detected)]["report"]
    assert "over dp_shard" in first or "over world" in first, first  # the mesh dimension where rank 0 stands
    assert "exit code" in text  # the launch failed: no rank went on
    if mode == "hang-stop":
        assert "SIGKILL" in text  # the stopped rank was killed (it can run no handler), not left behind
