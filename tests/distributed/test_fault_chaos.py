"""The chaos test (issue 13, sections 7 and 8): `nd-parallel train --max-restarts N` survives every fault kind, each
reported as it must be, and ends with exactly the parameters and losses of the same run left alone.

- one node, FSDP2 on 2 ranks: a mismatched config, kill -9 of a rank, a death in the middle of a save, SIGSTOP of a
  rank, a NaN, a death after the last checkpoint; the victims are drawn by a seeded generator
  (benchmarks/bench_chaos.py draws the steps too);
- two simulated nodes (two `nd-parallel train --nnodes 2` on this machine, c10d rendezvous on localhost), HSDP
  replicating across them: one node is killed whole and a fresh one takes its place.
"""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from nd_parallel.fault.watchdog import beat_for
from nd_parallel.testing.chaos import ChaosRun, Fault
from tests.distributed.train_yaml_helpers import write_model_and_data

SAVE_STEPS = 4
HANG = 15  # seconds; issue 13 asks tests for <= 30


def _yaml(data: dict, steps: int, **layout) -> dict:
    return {"base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}],
            "sequence_len": 32, "micro_batch_size": 2, "max_steps": steps, "learning_rate": 0.001,
            "lr_scheduler": "linear", "logging_steps": 1, "save_steps": SAVE_STEPS, "save_total_limit": 3, **layout}


def _assert_same_run(reference: Path, result, out: Path, steps: int) -> None:
    ref_log = [json.loads(x) for x in (reference / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in result.log] == list(range(1, steps + 1))  # one line per step, lost ones logged again
    assert [r["loss"] for r in result.log] == [r["loss"] for r in ref_log]
    assert [r["grad_norm"] for r in result.log] == [r["grad_norm"] for r in ref_log]
    a, b = load_file(str(reference / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_chaos_one_node_every_fault_kind(tmp_path):
    data = write_model_and_data(tmp_path, n=400)
    run = ChaosRun(_yaml(data, 40, dp_shard_size=2), tmp_path, nproc=2, hang_timeout=HANG, seed=13)
    reference = run.reference()
    faults = [Fault("mismatch"), Fault("kill", 6), Fault("save", 10), Fault("stop", 16), Fault("nan", 22),
              Fault("end")]
    result = run.run(faults)
    print(f"\nchaos, one node, FSDP2 on 2 ranks ({result.seconds:.0f} s):\n{result.table()}")
    m = {x.kind: x for x in result.measured}
    assert [x.kind for x in result.measured] == [f.kind for f in faults]
    # every fault stops every rank in time and is reported with what it was and where
    assert m["mismatch"].detected_s < 10 and "max_position_embeddings" in m["mismatch"].report
    assert m["mismatch"].resumed_from is None  # nothing saved yet: the next attempt starts from step 0
    for kind in ("kill", "save"):
        assert m[kind].detected_s < 10, m[kind]
    for x in result.measured:  # lose at most one checkpoint interval
        assert x.steps_lost <= SAVE_STEPS and x.resumed_step <= x.step, x
    # the save that died is never taken: the restart resumes from the checkpoint before it
    assert m["save"].step % SAVE_STEPS == 0 and m["save"].resumed_step == m["save"].step - SAVE_STEPS
    stop = m["stop"]
    assert stop.detected_s < HANG + 5, stop
    assert f"rank {stop.victim} (no heartbeat" in stop.report and "waits in" in stop.report, stop.report
    reported_step = int(re.search(r"at step (\d+)", stop.report).group(1))
    assert stop.step - 1 <= reported_step <= stop.step + 1, stop.report  # the run's step, not this attempt's count
    nan = m["nan"]
    assert nan.detected_s < 10 and f"optimizer step {nan.step} " in nan.report and "on rank" in nan.report
    assert nan.resumed_step < nan.step
    end = m["end"]  # a rank died after the last checkpoint: the restart finds the run done and trains no further
    assert end.step == 40 and end.resumed_step == 40 and end.steps_lost == 0 and end.detected_s < 10, end
    assert "checkpoint-40 is the run's last step: nothing left to train" in result.output
    _assert_same_run(reference, result, tmp_path / "chaos", 40)


def test_two_nodes_survive_a_node_failure_and_a_stopped_store_host(tmp_path):
    """HSDP 2x2: dp_replicate across the two nodes, dp_shard inside each. A node's torchrun agent is killed (its ranks
    must follow) and a fresh node replaces it; then rank 0, whose process serves the attempt's store, is stopped,
    which silences every heartbeat. The uninterrupted reference is one node with 4 ranks (the same mesh): the
    restarted two-node run must equal it bit for bit."""
    data = write_model_and_data(tmp_path, n=400)
    run = ChaosRun(_yaml(data, 30, dp_replicate_size=2, dp_shard_size=2), tmp_path, nproc=4, nnodes=2,
                   hang_timeout=HANG, seed=7)
    reference = run.reference(nnodes=1)
    result = run.run([Fault("node", 6), Fault("stop", 14, rank=0)])
    print(f"\nchaos, two nodes, HSDP 2x2 ({result.seconds:.0f} s):\n{result.table()}")
    node, stop = result.measured
    # Every rank, the killed agent's too, gone. The other node's ranks learn of the loss from the collective that
    # fails when the dead ranks' sockets close (about 2 s here), unless they were waiting where nothing fails: then
    # the hang watchdog reports within hang_timeout plus a beat's lateness (CI measured 12.4 s once).
    assert node.victim == 1, node
    if "the hang watchdog told them" in node.report:
        assert node.detected_s <= HANG + beat_for(HANG), node
    else:
        assert node.detected_s < 10, node
    assert node.resumed_from is not None and 0 < node.steps_lost <= SAVE_STEPS, node
    assert "the node that held rank 0 prints the summary" in result.output  # the other node's parent
    # the store's own timeout (10 s) comes on top of hang_timeout when its host is the one stopped
    assert stop.detected_s < HANG + 15 and "the store has not answered" in stop.report, stop
    assert 0 < stop.steps_lost <= SAVE_STEPS, stop
    _assert_same_run(reference, result, tmp_path / "chaos", 30)
