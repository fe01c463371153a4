"""`save_only_model`, `early_stopping_patience` and `load_best_model_at_end` through nd_parallel's checkpoints under
FSDP2 (2 CPU ranks, one launch for the four runs, built exactly as `nd-parallel train` builds them).

- save_only_model: every checkpoint-N is the model alone, gathered whole (config.json + model.safetensors, the
  tokenizer): no sharded state, no optimizer, scheduler or RNG file; it loads with from_pretrained and holds the
  weights of step N (the last one equals the final model); resuming from it is refused before any rank starts.
- early_stopping_patience: training stops once the eval loss has not improved for `patience` evaluations, and the
  model saved at the end is the best checkpoint's (its sharded state exported offline), not the last one's.
- load_best_model_at_end (no early stopping): every step runs, and the model saved at the end is the best
  checkpoint's.
- dynamic_checkpoint: a trigger file in output_dir makes every rank save a checkpoint at the next multiple of
  check_interval (the file is removed), and only then, with its sharded (resumable) state.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.train_yaml_helpers import jobs_for, logged, run_jobs, write_model_and_data, write_yaml

MAX_STEPS = 8


def _yaml(root: Path, data: dict, name: str, **keys) -> Path:
    cfg = {"base_model": data["model"], "datasets": [{"path": data["alpaca"], "type": "alpaca"}],
           "sequence_len": 256, "micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": MAX_STEPS,
           "optimizer": "adamw_torch", "lr_scheduler": "constant", "dp_shard_size": 2, "seed": 3,
           "output_dir": str(root / "out" / name), **keys}
    return write_yaml(root / f"{name}.yml", cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint_keys")
    data = write_model_and_data(root, n=24)
    paths = [_yaml(root, data, "model_only", save_only_model=True, save_steps=4, learning_rate=1e-3),
             # a large learning rate: the eval loss soon stops improving, so the run stops early
             _yaml(root, data, "early_stop", early_stopping_patience=1, val_set_size=0.25, eval_steps=1, save_steps=1,
                   learning_rate=0.05),
             # load_best_model_at_end without early stopping: all the steps, then the best checkpoint's model
             _yaml(root, data, "best_at_end", load_best_model_at_end=True, val_set_size=0.25, eval_steps=1,
                   save_steps=1, learning_rate=0.05),
             # dynamic_checkpoint: the trigger file is there from the start, looked for every 3 steps
             _yaml(root, data, "dynamic", dynamic_checkpoint={"enabled": True, "check_interval": 3},
                   learning_rate=1e-3)]
    trigger = root / "out" / "dynamic" / "axolotl_checkpoint.save"
    trigger.parent.mkdir(parents=True)
    trigger.touch()
    jobs = jobs_for(paths, root / "work", nproc=2)
    run_jobs(jobs, root / "work", nproc=2)
    return root, {job.name: job for job in jobs}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_only_model_checkpoints_hold_the_whole_model_only(runs):
    from transformers import AutoModelForCausalLM

    root, jobs = runs
    out = Path(jobs["model_only"].train.output_dir)
    for step in (4, MAX_STEPS):
        ckpt = out / f"checkpoint-{step}"
        names = {p.name for p in ckpt.iterdir()}
        assert {"config.json", "model.safetensors", "trainer_state.json", "tokenizer.json"} <= names, names
        assert not {"nd_parallel", "optimizer.pt", "scheduler.pt"} & names, names
        assert not any(n.startswith("rng_state") for n in names), names
    first, last, final = (_tensors(out / "checkpoint-4"), _tensors(out / f"checkpoint-{MAX_STEPS}"), _tensors(out))
    assert _same(last, final)  # the whole model at step 8, gathered from the FSDP2 shards
    assert not _same(first, last)  # checkpoint-4 holds step 4's weights
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-4", dtype=torch.float32)
    assert all(torch.equal(p, first[n]) for n, p in model.state_dict().items() if n in first)


def test_resuming_a_model_only_checkpoint_is_refused_before_any_rank(runs):
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.job import check_layout_rules
    from nd_parallel.config import ConfigError

    root, jobs = runs
    ckpt = Path(jobs["model_only"].train.output_dir) / "checkpoint-4"
    spec = json.loads((root / "model_only.yml").read_text())
    path = write_yaml(root / "resume.yml", {**spec, "resume_from_checkpoint": str(ckpt)})
    with pytest.raises(ConfigError, match=r"holds the model only \(saved with save_only_model"):
        check_layout_rules(load_train_config(path, environ={}), path)


@pytest.mark.parametrize("name", ["early_stop", "best_at_end"])
def test_the_best_checkpoint_is_the_final_model(runs, tmp_path, name):
    from nd_parallel.checkpoint import export_checkpoint

    root, jobs = runs
    out = Path(jobs[name].train.output_dir)
    steps = [r["step"] for r in logged(out)]
    evals = logged(out, "eval_log.jsonl")
    assert steps == list(range(1, len(steps) + 1)), steps
    assert (len(steps) < MAX_STEPS) == (name == "early_stop"), (steps, evals)  # early stopping stopped early
    last = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    state = json.loads((out / f"checkpoint-{last}" / "trainer_state.json").read_text())
    best = state["best_global_step"]
    losses = {e["step"]: e["eval_loss"] for e in evals}
    assert losses[best] == min(losses.values()) and best < last == steps[-1], (best, last, losses)
    for step in (best, last):
        export_checkpoint(out / f"checkpoint-{step}" / "nd_parallel", tmp_path / str(step))
    final = _tensors(out)
    assert _same(final, _tensors(tmp_path / str(best)))  # the best checkpoint's model, read back under FSDP2
    assert not _same(final, _tensors(tmp_path / str(last)))


def test_a_trigger_file_saves_one_checkpoint(runs):
    root, jobs = runs
    out = Path(jobs["dynamic"].train.output_dir)
    assert not (out / "axolotl_checkpoint.save").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert (out / "checkpoint-3" / "nd_parallel").is_dir()  # the sharded state: a resumable checkpoint
    assert [r["step"] for r in logged(out)] == list(range(1, MAX_STEPS + 1))
