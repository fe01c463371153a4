"""Trainer rows: an unchanged transformers.Trainer with NDParallelCallback matches the Trainer in one process.

Same data, seed, gradient accumulation (2) and linear LR schedule; the one-process Trainer's per-device batch is
the layout's global batch. Compared: every logged loss and grad norm (rtol 1e-5) and every parameter at the end
(atol 1e-5). Also: a LoRA model under FSDP2xTP2, a run that checkpoints at step 2 (sharded, through the Trainer's
save_strategy) and is resumed under another layout with train(resume_from_checkpoint=...), and save_model.
Evaluation: every parity row evaluates every 2 steps inside train() and twice after it (with logits and
compute_metrics, then prediction_loss_only=True); eval losses match the one-process Trainer at rtol 1e-5, under
PP through the forward-only schedule. bf16 / gradient checkpointing: TrainingArguments(bf16=True) under FSDP2
matches the one-process bf16 Trainer at the derived bf16 tolerance (test_train_modes.py), and
gradient_checkpointing=True runs nd_parallel's checkpointing (HF's is taken over at prepare) and changes nothing.
"""

import json
import subprocess
import sys

import pytest
import torch

WORKER = "tests/distributed/trainer_worker.py"
ARGS = dict(gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, logging_steps=1, save_strategy="no",
            adam_epsilon=1e-6, weight_decay=0.01, seed=0, lr_scheduler_type="linear", max_grad_norm=1.0)
PER_RANK = 2
EVAL = dict(n=8, seq_len=24, seed=1)
EV = {"eval": EVAL}
BF16_U = 2.0 ** -8  # bf16 unit roundoff: the loss / grad-norm tolerances derived in test_train_modes.py
GC_TOL = 1e-6
# launch -> (world, {row: (config, extras)})
LAUNCHES = {
    "2r": (2, {"ddp2": ({"dp_replicate_size": 2}, EV), "pp2": ({"pp_size": 2}, EV), "cp2": ({"cp_size": 2}, EV),
               "fsdp2": ({"dp_shard_size": 2}, EV), "tp2": ({"tp_size": 2}, EV),
               "gc_fsdp2": ({"dp_shard_size": 2}, {**EV, "train": {"gradient_checkpointing": True}}),
               "bf16_fsdp2": ({"dp_shard_size": 2}, {"train": {"bf16": True}}),
               # same dp size (same global batches), another layout: the pipeline's checkpoint loads under CP
               "save_pp2": ({"pp_size": 2}, {"save": True}),
               "resume_cp2": ({"cp_size": 2}, {"resume": "save_pp2/checkpoint-2"})}),
    # fp16 (issue 19): TrainingArguments(fp16=True) through the callback, loss scaling included
    "fp16": (2, {"fp16_fsdp2": ({"dp_shard_size": 2}, {"train": {"fp16": True}}),
                 "fp16_pp2": ({"pp_size": 2}, {"train": {"fp16": True}})}),
    "4r": (4, {"fsdp2_tp2": ({"dp_shard_size": 2, "tp_size": 2}, EV), "pp2_tp2": ({"pp_size": 2, "tp_size": 2}, EV),
               "lora_fsdp2_tp2": ({"dp_shard_size": 2, "tp_size": 2}, {"lora": True, "save_model": "adapter", **EV})}),
}
PARITY = [(n, row) for n, (_, rows) in LAUNCHES.items() for row in rows
          if not row.startswith(("save_", "resume_", "gc_", "bf16_", "fp16_"))]


def _dp(config, world):
    return world // (config.get("tp_size", 1) * config.get("pp_size", 1) * config.get("cp_size", 1))


def _train_args(config, world, extras, per_rank):
    args = dict(ARGS, per_device_train_batch_size=per_rank, **extras.get("train", {}))
    if extras.get("eval"):
        args.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=per_rank)
    if extras.get("save"):
        args.update(save_strategy="steps", save_steps=2)
    return args


def _spec(model_dir, runs):
    return {"model": model_dir, "samples": dict(n=64, seq_len=24), "runs": runs}


def _launch_spec(name, out, model_dir):
    """Every row of the launch; checkpoint and save_model paths live in its output directory."""
    world, rows = LAUNCHES[name]
    spec_runs = []
    for row, (config, extras) in rows.items():
        extras = {k: (str(out / v) if k in ("resume", "save_model") else v) for k, v in extras.items()}
        spec_runs.append([row, config, _train_args(config, world, extras, PER_RANK), extras])
    return _spec(model_dir, spec_runs)


@pytest.fixture(scope="module")
def runs(tiny_model, launch_worker):
    """launch name -> directory of the main process's results, launched lazily once per launch."""
    return lambda name: launch_worker(f"trainer_{name}", WORKER, LAUNCHES[name][0],
                                      lambda out: _launch_spec(name, out, tiny_model("llama")))


@pytest.fixture(scope="module")
def references(tiny_model, memo, worker_env, tmp_path_factory):
    """The one-process Trainer whose per-device batch is the layout's global batch: (dp, lora, bf16) -> results."""
    def run_reference(dp, lora, bf16, fp16=False):
        out = tmp_path_factory.mktemp("trainer_ref")
        # bf16 / fp16: nd_parallel's recipe in one process (the callback with a one-process layout), as the bf16
        # rows of test_train_modes.py do; Accelerate's own bf16 is autocast, a different per-op recipe.
        half = {"bf16": True} if bf16 else {"fp16": True} if fp16 else None
        extras = {"lora": lora, "train": half} if half else {"lora": lora, **EV}
        run = ["ref", {} if half else None, _train_args({}, 1, extras, PER_RANK * dp), extras]
        (out / "spec.json").write_text(json.dumps(_spec(tiny_model("llama"), [run])))
        subprocess.run([sys.executable, WORKER, str(out), str(out / "spec.json")], check=True,
                       capture_output=True, env={**worker_env, "ACCELERATE_USE_CPU": "true"})
        return torch.load(out / "ref.pt", weights_only=True)

    return lambda dp, lora, bf16=False, fp16=False: memo((dp, lora, bf16, fp16),
                                                         lambda: run_reference(dp, lora, bf16, fp16))


def _close(run, ref):
    assert len(run["losses"]) == len(ref["losses"]) == ARGS["max_steps"]
    for key in ("losses", "norms"):
        for a, b in zip(run[key], ref[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, run[key], ref[key])
    assert set(run["state"]) == set(ref["state"])
    diff = max((run["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
    assert diff <= 1e-5, diff
    return diff


def _row_and_reference(launch_name, row, runs, references):
    """A parity row's results and the one-process Trainer's on the same global batches (same LoRA or not)."""
    world, rows = LAUNCHES[launch_name]
    config, extras = rows[row]
    run = torch.load(runs(launch_name) / f"{row}.pt", weights_only=True)
    return run, references(_dp(config, world), bool(extras.get("lora")))


@pytest.mark.parametrize("launch_name,row", PARITY, ids=[f"{a}-{r}" for a, r in PARITY])
def test_trainer_matches_one_process(launch_name, row, runs, references):
    run, ref = _row_and_reference(launch_name, row, runs, references)
    diff = _close(run, ref)
    print(f"trainer {row}: losses {run['losses']} param diff {diff}")
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("launch_name,row", PARITY, ids=[f"{a}-{r}" for a, r in PARITY])
def test_trainer_evaluates_like_one_process(launch_name, row, runs, references):
    run, ref = _row_and_reference(launch_name, row, runs, references)
    assert len(run["eval_losses"]) == len(ref["eval_losses"]) == 2  # eval_steps=2 inside train()
    for a, b in zip(run["eval_losses"], ref["eval_losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (run["eval_losses"], ref["eval_losses"])
    got, want = run["after"], ref["after"]
    for key in ("full_loss", "lossonly_loss"):
        assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (key, got, want)
    assert got["full_n"] == want["full_n"] == EVAL["n"]  # logits gathered over the dp ranks only, no duplicates
    assert got["full_acc"] == want["full_acc"] and abs(got["full_mean_logit"] - want["full_mean_logit"]) <= 1e-5
    diffs = [abs(a - b) / abs(b) for a, b in zip(run["eval_losses"] + [got["full_loss"], got["lossonly_loss"]],
                                                 ref["eval_losses"] + [want["full_loss"], want["lossonly_loss"]])]
    print(f"trainer eval {row}: losses {run['eval_losses']} {got['full_loss']} max rel diff {max(diffs):.2e}")


def test_trainer_gradient_checkpointing_runs_ours_and_changes_nothing(runs):
    out = runs("2r")
    plain, gc = (torch.load(out / f"{r}.pt", weights_only=True) for r in ("fsdp2", "gc_fsdp2"))
    assert plain["checkpointed"] == 0 and gc["checkpointed"] > 0  # TrainingArguments' flag -> our "full" mode
    for key in ("losses", "norms", "eval_losses"):
        for a, b in zip(gc[key], plain[key]):
            assert abs(a - b) <= GC_TOL * abs(b), (key, gc[key], plain[key])
    diff = max((gc["state"][k] - v).abs().max().item() for k, v in plain["state"].items())
    assert diff <= GC_TOL, diff
    print(f"trainer gradient_checkpointing fsdp2: {gc['checkpointed']} layers, param diff {diff}")


def test_trainer_bf16_matches_one_process_bf16(runs, references):
    run = torch.load(runs("2r") / "bf16_fsdp2.pt", weights_only=True)
    fp32 = torch.load(runs("2r") / "fsdp2.pt", weights_only=True)
    ref = references(2, False, bf16=True)
    assert len(run["losses"]) == len(ref["losses"]) == ARGS["max_steps"]
    rel = {key: max(abs(a - b) / abs(b) for a, b in zip(run[key], ref[key])) for key in ("losses", "norms")}
    assert rel["losses"] <= BF16_U and rel["norms"] <= 4 * BF16_U, (rel, run, ref)
    assert run["losses"] != fp32["losses"]  # bf16 compute really ran
    assert all(v.dtype == torch.float32 for v in run["state"].values())  # fp32 master weights
    print(f"trainer bf16 fsdp2 vs one-process bf16: max rel loss {rel['losses']:.2e} norm {rel['norms']:.2e}")


@pytest.mark.parametrize("row", ["fp16_fsdp2", "fp16_pp2"])
def test_trainer_fp16_matches_one_process_fp16(row, runs, references):
    """TrainingArguments(fp16=True): the loss scale reaches FSDP2's and the pipeline's backward alike; the fp16
    tolerances derived in test_fp16.py (loss u, norm 4u, u = 2**-11)."""
    run = torch.load(runs("fp16") / f"{row}.pt", weights_only=True)
    ref = references(2 if "fsdp" in row else 1, False, fp16=True)
    assert len(run["losses"]) == len(ref["losses"]) == ARGS["max_steps"]
    rel = {key: max(abs(a - b) / abs(b) for a, b in zip(run[key], ref[key])) for key in ("losses", "norms")}
    assert rel["losses"] <= 2.0 ** -11 and rel["norms"] <= 4 * 2.0 ** -11, (rel, run, ref)
    assert run["scale"] == ref["scale"] is not None, (run["scale"], ref["scale"])
    assert all(v.dtype == torch.float32 for v in run["state"].values())  # fp32 master weights
    print(f"trainer {row} vs one-process fp16: max rel loss {rel['losses']:.2e} norm {rel['norms']:.2e}, "
          f"scale {run['scale']}")


def test_trainer_resumes_under_another_layout(runs):
    out = runs("2r")
    whole = torch.load(out / "save_pp2.pt", weights_only=True)
    resumed = torch.load(out / "resume_cp2.pt", weights_only=True)
    assert (out / "save_pp2" / "checkpoint-2" / "nd_parallel" / "nd_parallel.json").is_file()
    assert resumed["steps"] == [1, 2, 3, 4]  # steps 1-2 come from the checkpoint's trainer_state.json
    for a, b in zip(resumed["losses"][2:], whole["losses"][2:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed["losses"], whole["losses"])
    assert max((resumed["state"][k] - v).abs().max().item() for k, v in whole["state"].items()) <= 1e-5


def test_trainer_save_model_writes_the_adapter(runs, references):
    """trainer.save_model under FSDP2xTP2 writes the adapter the one-process Trainer trained, tensor by tensor."""
    from safetensors.torch import load_file

    out = runs("4r") / "adapter"
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    exported = load_file(out / "adapter_model.safetensors")
    _, ref = _row_and_reference("4r", "lora_fsdp2_tp2", runs, references)
    want = ref["adapter"]
    assert set(exported) == set(want), sorted(set(exported) ^ set(want))
    worst = max((exported[k] - v).abs().max().item() for k, v in want.items())
    print(f"trainer save_model adapter vs one-process Trainer: max abs {worst:.1e}")
    assert worst <= 1e-5, worst
    assert all(v.abs().max() > 1e-4 for k, v in want.items() if ".lora_B." in k)  # trained: B left its zero init
