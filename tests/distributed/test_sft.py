"""TRL SFTTrainer rows: an unchanged SFTTrainer with NDParallelCallback matches SFTTrainer in one process.

A covering design over layouts x recipes (and one row saved and resumed under FSDP2) (every layout runs at least one recipe, every recipe at least two
layouts, packing on CP and on PP), two launches (2 and 4 ranks) running several rows each. Same data, seed,
gradient accumulation (2) and linear schedule; the one-process SFTTrainer's per-device batch is the layout's global
batch. Compared: every logged loss, grad norm and entropy (rtol 1e-5), mean_token_accuracy and num_tokens (the
same token sums: equal up to float32 vs float64 rounding), every parameter at the end (atol 1e-5) and, where the
row evaluates, the eval loss. bf16=False everywhere: SFTConfig turns bf16 on by default, and one process runs it
as Accelerate's autocast while nd_parallel runs FSDP2's precision policy (another per-op recipe).
"""

import json
import subprocess
import sys

import pytest
import torch

WORKER = "tests/distributed/sft_worker.py"
ARGS = dict(gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, logging_steps=1, save_strategy="no",
            adam_epsilon=1e-6, weight_decay=0.01, seed=0, lr_scheduler_type="linear", max_grad_norm=1.0,
            max_length=32, bf16=False)
PER_RANK = 2
EVAL = {"eval": True}
PACKED = {"packing": True}
SAVE_2 = {"save_strategy": "steps", "save_steps": 2}
ONE_ROW = {"pp_microbatches": 1, "pp_schedule": "gpipe"}  # padding_free: a rank's batch is one packed row
# launch -> (world, {row: (config, extras)}); extras: data (text / completion / chat), lora, sft (SFTConfig), eval
LAUNCHES = {
    "2r": (2, {"ddp2": ({"dp_replicate_size": 2}, {"data": "text", **EVAL}),
               "fsdp2": ({"dp_shard_size": 2}, {"data": "chat", "lora": True}),
               "tp2": ({"tp_size": 2}, {"data": "completion"}),
               "pp2": ({"pp_size": 2, **ONE_ROW}, {"data": "text", "sft": PACKED, **EVAL}),
               "cp2": ({"cp_size": 2}, {"data": "chat", "sft": PACKED, **EVAL}),
               # saved at step 2, then resumed by a new SFTTrainer from that checkpoint: steps 1-2 come from its
               # trainer_state.json, step 3 and the final parameters from the resumed run
               "fsdp2_resume": ({"dp_shard_size": 2}, {"data": "text", "sft": SAVE_2, "resume": 2})}),
    "4r": (4, {"fsdp2_tp2": ({"dp_shard_size": 2, "tp_size": 2}, {"data": "chat", "lora": True}),
               "cp2_pp2": ({"cp_size": 2, "pp_size": 2, **ONE_ROW}, {"data": "completion", "sft": PACKED})}),
}
ROWS = [(n, row) for n, (_, rows) in LAUNCHES.items() for row in rows]


def _dp(config, world):
    return world // (config.get("tp_size", 1) * config.get("pp_size", 1) * config.get("cp_size", 1))


def _sft_args(extras, per_rank):
    args = dict(ARGS, per_device_train_batch_size=per_rank)
    args.update(extras.get("sft", {}))
    if extras.get("eval"):
        args.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=per_rank)
    return args


def _reference_key(launch_name, row):
    world, rows = LAUNCHES[launch_name]
    config, extras = rows[row]
    # a resumed row is compared with the uninterrupted one-process run
    return json.dumps([_dp(config, world), {k: v for k, v in extras.items() if k != "resume"}], sort_keys=True)


@pytest.fixture(scope="module")
def runs(tiny_model, launch_worker):
    def spec(name, out):
        world, rows = LAUNCHES[name]
        return {"model": tiny_model("llama"),
                "runs": [[row, config, _sft_args(extras, PER_RANK), extras] for row, (config, extras) in rows.items()]}

    return lambda name: launch_worker(f"sft_{name}", WORKER, LAUNCHES[name][0], lambda out: spec(name, out))


@pytest.fixture(scope="module")
def references(tiny_model, memo, worker_env, tmp_path_factory):
    """Every row's one-process SFTTrainer (per-device batch = the row's global batch), all in ONE process."""
    def run_all():
        out = tmp_path_factory.mktemp("sft_ref")
        keys = sorted({_reference_key(n, r) for n, r in ROWS})
        spec_runs = []
        for i, key in enumerate(keys):
            dp, extras = json.loads(key)
            spec_runs.append([f"ref{i}", None, _sft_args(extras, PER_RANK * dp), extras])
        (out / "spec.json").write_text(json.dumps({"model": tiny_model("llama"), "runs": spec_runs}))
        subprocess.run([sys.executable, WORKER, str(out), str(out / "spec.json")], check=True,
                       capture_output=True, env={**worker_env, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"})
        return {key: torch.load(out / f"ref{i}.pt", weights_only=True) for i, key in enumerate(keys)}

    return lambda launch_name, row: memo("all", run_all)[_reference_key(launch_name, row)]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("launch_name,row", ROWS, ids=[f"{a}-{r}" for a, r in ROWS])
def test_sft_trainer_matches_one_process(launch_name, row, runs, references):
    run = torch.load(runs(launch_name) / f"{row}.pt", weights_only=True)
    ref = references(launch_name, row)
    assert len(run["loss"]) == len(ref["loss"]) == ARGS["max_steps"]
    for key in ("loss", "grad_norm", "entropy"):
        for a, b in zip(run[key], ref[key]):
            assert _rel(a, b) <= 1e-5, (key, run[key], ref[key])
    resumed_at = LAUNCHES[launch_name][1][row][1].get("resume", 0)
    if resumed_at:  # TRL keeps its running token count in the trainer object: a resumed trainer counts from 0
        ref = dict(ref, num_tokens=ref["num_tokens"][:resumed_at] + [
            n - ref["num_tokens"][resumed_at - 1] for n in ref["num_tokens"][resumed_at:]])
    assert run["num_tokens"] == ref["num_tokens"]  # global over dp, counted once per batch (not per cp/tp/pp rank)
    for a, b in zip(run["mean_token_accuracy"], ref["mean_token_accuracy"]):
        assert abs(a - b) <= 1e-6, (run["mean_token_accuracy"], ref["mean_token_accuracy"])
    assert max(ref["mean_token_accuracy"]) > 0  # the metric is exercised, not 0 == 0
    assert len(run["eval_losses"]) == len(ref["eval_losses"])
    for a, b in zip(run["eval_losses"] + run["eval_accuracy"], ref["eval_losses"] + ref["eval_accuracy"]):
        assert _rel(a, b) <= 1e-5, (run["eval_losses"], ref["eval_losses"])
    assert set(run["state"]) == set(ref["state"])
    diff = max((run["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
    assert diff <= 1e-5, diff
    if resumed_at:  # and the resumed run ends exactly where the same layout's uninterrupted run ended
        assert all(torch.equal(run["state"][k], v) for k, v in run["uninterrupted"].items())
    assert ref["loss"][-1] < ref["loss"][0]
    print(f"sft {row}: losses {run['loss']} acc {run['mean_token_accuracy']} param diff {diff:.1e}")
