"""Trainer rows: an unchanged transformers.Trainer with NDParallelCallback matches the Trainer in one process.

Same data, seed, gradient accumulation (2) and linear LR schedule; the one-process Trainer's per-device batch is
the layout's global batch. Compared: every logged loss and grad norm (rtol 1e-5) and every parameter at the end
(atol 1e-5). Also: a LoRA model under FSDP2xTP2, a run that checkpoints at step 2 (sharded, through the Trainer's
save_strategy) and is resumed under another layout with train(resume_from_checkpoint=...), and save_model.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nd_parallel.launch import launch

WORKER = "tests/distributed/trainer_worker.py"
HERE = str(Path(__file__).parent)
# The rank programs import peft_recipe from here; a PYTHONPATH already set (e.g. another transformers) is kept.
PYPATH = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
ARGS = dict(gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, logging_steps=1, save_strategy="no",
            adam_epsilon=1e-6, weight_decay=0.01, seed=0, lr_scheduler_type="linear", max_grad_norm=1.0)
PER_RANK = 2
# launch -> (world, {row: (config, extras)})
LAUNCHES = {
    "2r": (2, {"ddp2": ({"dp_replicate_size": 2}, {}), "pp2": ({"pp_size": 2}, {}), "cp2": ({"cp_size": 2}, {}),
               # same dp size (same global batches), another layout: the pipeline's checkpoint loads under CP
               "save_pp2": ({"pp_size": 2}, {"save": True}),
               "resume_cp2": ({"cp_size": 2}, {"resume": "save_pp2/checkpoint-2"})}),
    "4r": (4, {"fsdp2_tp2": ({"dp_shard_size": 2, "tp_size": 2}, {}),
               "lora_fsdp2_tp2": ({"dp_shard_size": 2, "tp_size": 2}, {"lora": True, "save_model": "adapter"})}),
}
PARITY = [(n, row) for n, (_, rows) in LAUNCHES.items() for row in rows if not row.startswith(("save_", "resume_"))]


def _dp(config, world):
    return world // (config.get("tp_size", 1) * config.get("pp_size", 1) * config.get("cp_size", 1))


def _train_args(config, world, extras, per_rank):
    args = dict(ARGS, per_device_train_batch_size=per_rank)
    if extras.get("save"):
        args.update(save_strategy="steps", save_steps=2)
    return args


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from nd_parallel.toy import save_tiny_model

    return str(save_tiny_model("llama", tmp_path_factory.mktemp("trainer_model") / "llama"))


def _spec(out, model_dir, runs):
    path = out / f"spec_{len(list(out.glob('spec_*')))}.json"
    path.write_text(json.dumps({"model": model_dir, "samples": dict(n=64, seq_len=24), "runs": runs}))
    return path


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    done = {}

    def get(name):
        if name not in done:
            world, rows = LAUNCHES[name]
            out = tmp_path_factory.mktemp(f"trainer_{name}")
            spec_runs = []
            for row, (config, extras) in rows.items():
                extras = {k: (str(out / v) if k in ("resume", "save_model") else v) for k, v in extras.items()}
                spec_runs.append([row, config, _train_args(config, world, extras, PER_RANK), extras])
            launch(WORKER, world, [str(out), str(_spec(out, model_dir, spec_runs))], timeout=900, capture=True,
                   env={"PYTHONPATH": PYPATH})
            done[name] = out
        return done[name]

    return get


@pytest.fixture(scope="module")
def references(model_dir, tmp_path_factory):
    cache = {}

    def get(dp, lora):
        if (dp, lora) not in cache:
            out = tmp_path_factory.mktemp("trainer_ref")
            spec = _spec(out, model_dir, [["ref", None, dict(ARGS, per_device_train_batch_size=PER_RANK * dp),
                                           {"lora": lora}]])
            subprocess.run([sys.executable, WORKER, str(out), str(spec)], check=True, capture_output=True,
                           env={**os.environ, "PYTHONPATH": PYPATH, "ACCELERATE_USE_CPU": "true"})
            cache[dp, lora] = torch.load(out / "ref.pt", weights_only=True)
        return cache[dp, lora]

    return get


def _close(run, ref):
    assert len(run["losses"]) == len(ref["losses"]) == ARGS["max_steps"]
    for key in ("losses", "norms"):
        for a, b in zip(run[key], ref[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, run[key], ref[key])
    assert set(run["state"]) == set(ref["state"])
    diff = max((run["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
    assert diff <= 1e-5, diff
    return diff


@pytest.mark.parametrize("launch_name,row", PARITY, ids=[f"{a}-{r}" for a, r in PARITY])
def test_trainer_matches_one_process(launch_name, row, runs, references):
    world, rows = LAUNCHES[launch_name]
    config, extras = rows[row]
    run = torch.load(runs(launch_name) / f"{row}.pt", weights_only=True)
    ref = references(_dp(config, world), bool(extras.get("lora")))
    diff = _close(run, ref)
    print(f"trainer {row}: losses {run['losses']} param diff {diff}")
    assert ref["losses"][-1] < ref["losses"][0]


def test_trainer_resumes_under_another_layout(runs):
    out = runs("2r")
    whole = torch.load(out / "save_pp2.pt", weights_only=True)
    resumed = torch.load(out / "resume_cp2.pt", weights_only=True)
    assert (out / "save_pp2" / "checkpoint-2" / "nd_parallel" / "nd_parallel.json").is_file()
    assert resumed["steps"] == [1, 2, 3, 4]  # steps 1-2 come from the checkpoint's trainer_state.json
    for a, b in zip(resumed["losses"][2:], whole["losses"][2:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed["losses"], whole["losses"])
    assert max((resumed["state"][k] - v).abs().max().item() for k, v in whole["state"].items()) <= 1e-5


def test_trainer_save_model_writes_the_adapter(runs):
    out = runs("4r") / "adapter"
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
