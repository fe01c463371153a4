"""Axolotl keys that are the Trainer's: `lr_quadratic_warmup` (Axolotl's cosine with quadratic warm-up, the same
numbers as its formula and, when its venv is there, as its own scheduler), `save_only_model` (model-only
checkpoints, refused as resume points before any rank starts) and `early_stopping_patience` (the
EarlyStoppingCallback with load_best_model_at_end, Axolotl's rules), read by `nd-parallel train` in one process.
The checkpoints themselves under FSDP2: tests/distributed/test_train_checkpoint_keys.py."""

import math
import re

import pytest
import torch

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.job import check_layout_rules, trainer_arguments
from nd_parallel.cli.train.schedules import cosine_with_quadratic_warmup, use_quadratic_warmup
from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import write_model_and_data, write_yaml
from tests.unit.axolotl_venv import run_in_axolotl


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_model_and_data(tmp_path_factory.mktemp("trainer_keys"), n=20)


def _config(tmp_path, data, **keys):
    keys = {"base_model": data["model"], "datasets": [{"path": data["alpaca"], "type": "alpaca"}],
            "sequence_len": 256, "output_dir": str(tmp_path / "out"), **keys}
    return load_train_config(write_yaml(tmp_path / "c.yml", keys), environ={})


def _refusal(tmp_path, data, **keys) -> str:
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, data, **keys)
    return str(err.value)


def _lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _optimizer(lr: float = 0.1):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_quadratic_warmup_is_axolotls_formula():
    """Axolotl 0.19's get_cosine_schedule_with_quadratic_warmup: (s / w)^2 during warm-up, then the half cosine."""
    warmup, total, lr = 3, 10, 0.1
    want = [lr * (s / warmup) ** 2 if s < warmup else
            lr * max(0.0, 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))) for s in range(total)]
    got = _lrs(cosine_with_quadratic_warmup(_optimizer(lr), warmup, total), total)
    assert got == pytest.approx(want, rel=0, abs=1e-15)
    assert got[:4] == pytest.approx([0.0, lr / 9, 4 * lr / 9, lr], abs=1e-15)  # not linear (lr / 3, 2 lr / 3)


_AXOLOTL_LRS = """
import json, sys, torch
from axolotl.utils.schedulers import get_cosine_schedule_with_quadratic_warmup
warmup, total = int(sys.argv[1]), int(sys.argv[2])
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
sched = get_cosine_schedule_with_quadratic_warmup(opt, num_warmup_steps=warmup, num_training_steps=total)
out = []
for _ in range(total):
    out.append(sched.get_last_lr()[0]); opt.step(); sched.step()
print(json.dumps(out))
"""


@pytest.mark.parametrize("warmup,total", [(3, 10), (0, 5), (4, 4)])
def test_quadratic_warmup_equals_axolotls_scheduler(warmup, total):
    """Axolotl's own scheduler, run in its venv: the same learning rates, bit for bit."""
    theirs = run_in_axolotl("-c", _AXOLOTL_LRS, str(warmup), str(total), timeout=600)
    assert _lrs(cosine_with_quadratic_warmup(_optimizer(), warmup, total), total) == theirs


def test_the_trainer_builds_the_quadratic_schedule(tmp_path, data):
    """The rank's Trainer (one process, no layout): create_scheduler gives Axolotl's schedule with the Trainer's
    warm-up count (warmup_ratio 0.3 of 10 steps = 3), and the YAML key reaches it."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    cfg = _config(tmp_path, data, lr_quadratic_warmup=True, warmup_ratio=0.3, max_steps=10, learning_rate=0.1)
    assert cfg.lr_quadratic_warmup is True
    args = trainer_arguments(cfg, "q", train_rows=20, eval_rows=0, dp=1)
    model = AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32)
    trainer = Trainer(model=model, args=TrainingArguments(**args))
    use_quadratic_warmup(trainer)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    lrs = [group["lr"] for group in trainer.optimizer.param_groups]
    assert lrs and all(lr == 0.0 for lr in lrs)
    want = _lrs(cosine_with_quadratic_warmup(_optimizer(0.1), 3, 10), 10)
    assert _lrs(trainer.lr_scheduler, 10) == pytest.approx(want, rel=1e-12)


def test_quadratic_warmup_refusals(tmp_path, data):
    message = _refusal(tmp_path, data, lr_quadratic_warmup=True, lr_scheduler="linear")
    assert "lr_quadratic_warmup with lr_scheduler='linear'" in message and "set lr_scheduler: cosine" in message
    message = _refusal(tmp_path, data, lr_quadratic_warmup=True, cosine_min_lr_ratio=0.1)
    assert "drops the floor" in message and "keep one" in message
    assert "lr_quadratic_warmup='yes'; use true or false" in _refusal(tmp_path, data, lr_quadratic_warmup="yes")


def test_save_only_model_reaches_the_trainer_and_its_checkpoints_are_refused_as_resume_points(tmp_path, data):
    cfg = _config(tmp_path, data, save_only_model=True, save_steps=2, max_steps=4)
    args = trainer_arguments(cfg, "s", train_rows=20, eval_rows=0, dp=1)
    assert args["save_only_model"] is True and args["save_strategy"] == "steps" and args["save_steps"] == 2
    assert "save_only_model" not in trainer_arguments(_config(tmp_path, data), "s", 20, 0, 1)
    ckpt = tmp_path / "out" / "checkpoint-2"  # what a save_only_model checkpoint holds: the model, no state
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"")
    resumed = _config(tmp_path, data, resume_from_checkpoint=str(ckpt))
    with pytest.raises(ConfigError, match=r"holds the model only \(saved with save_only_model.*cannot be resumed.*"
                                          r"base_model, or lora_model_dir"):
        check_layout_rules(resumed, "c.yml")
    foreign = tmp_path / "empty"
    foreign.mkdir()
    with pytest.raises(ConfigError, match="has no nd_parallel/ folder"):
        check_layout_rules(_config(tmp_path, data, resume_from_checkpoint=str(foreign)), "c.yml")
    message = _refusal(tmp_path, data, save_only_model=True, auto_resume_from_checkpoints=True)
    assert "save_only_model with resume_from_checkpoint: auto" in message and "cannot be resumed" in message


def test_the_trainer_plugin_refuses_save_only_model_with_the_best_model_reload():
    from transformers import TrainingArguments

    from nd_parallel.config import ParallelismConfig
    from nd_parallel.plugins.trainer.adopt import check_trainer_args

    args = TrainingArguments(output_dir="unused", save_only_model=True, load_best_model_at_end=True,
                             eval_strategy="steps", save_strategy="steps", use_cpu=True)
    with pytest.raises(ValueError, match="save_only_model=True with load_best_model_at_end=True.*drop one"):
        check_trainer_args(args, None, ParallelismConfig())


def test_early_stopping_adds_the_callback_and_the_best_model_reload(tmp_path, data):
    from transformers import EarlyStoppingCallback

    from nd_parallel.cli.train.callbacks import watchdog

    cfg = _config(tmp_path, data, early_stopping_patience=2, save_steps=4, eval_steps=2, val_set_size=0.2)
    args = trainer_arguments(cfg, "e", train_rows=16, eval_rows=4, dp=1)
    assert args["load_best_model_at_end"] is True
    assert (args["eval_strategy"], args["eval_steps"], args["save_strategy"], args["save_steps"]) == (
        "steps", 2, "steps", 4)
    [callback] = watchdog(cfg)
    assert isinstance(callback, EarlyStoppingCallback) and callback.early_stopping_patience == 2
    assert watchdog(_config(tmp_path, data)) == []


@pytest.mark.parametrize("keys,match", [
    ({"eval_steps": 2}, r"save_steps=None, eval_steps=2: set both"),
    ({"save_steps": 3, "eval_steps": 2}, "save_steps=3 not a multiple of eval_steps=2"),
    ({"save_steps": 2, "eval_steps": 2, "val_set_size": 0}, "without val_set_size"),
    ({"save_steps": 2, "eval_steps": 2, "save_only_model": True}, "early_stopping_patience with save_only_model"),
    ({"early_stopping_patience": 0, "save_steps": 2, "eval_steps": 2}, "must be an integer >= 1"),
])
def test_early_stopping_refusals_are_axolotls_rules(tmp_path, data, keys, match):
    keys = {"early_stopping_patience": 3, "val_set_size": 0.2, **keys}
    assert re.search(match, _refusal(tmp_path, data, **keys))


def test_load_best_model_at_end_reloads_the_best_checkpoint_without_early_stopping(tmp_path, data):
    """Axolotl's load_best_model_at_end: true (its default false) without early_stopping_patience: the Trainer's
    reload at the end, no EarlyStoppingCallback. Where Axolotl silently leaves it off (no evaluation split, save and
    eval steps unset or not dividing), the config stage refuses it with the fix."""
    from nd_parallel.cli.train.callbacks import watchdog

    cfg = _config(tmp_path, data, load_best_model_at_end=True, save_steps=4, eval_steps=2, val_set_size=0.2)
    args = trainer_arguments(cfg, "b", train_rows=16, eval_rows=4, dp=1)
    assert args["load_best_model_at_end"] is True and watchdog(cfg) == []
    assert "load_best_model_at_end" not in trainer_arguments(_config(tmp_path, data), "b", 16, 0, 1)
    assert re.search(r"load_best_model_at_end with save_steps=None, eval_steps=None: set both",
                     _refusal(tmp_path, data, load_best_model_at_end=True, val_set_size=0.2))
    assert "load_best_model_at_end without val_set_size" in _refusal(
        tmp_path, data, load_best_model_at_end=True, save_steps=2, eval_steps=2)
    assert "load_best_model_at_end='yes'; use true or false" in _refusal(tmp_path, data, load_best_model_at_end="yes")


def test_adam_eps_is_accepted_as_axolotl_drops_it(tmp_path, data):
    """`adam_eps` (btlm-ft.yml, next to lr_quadratic_warmup) is not in Axolotl 0.19's schema, whose pydantic model
    ignores unknown keys: AdamW keeps the Trainer's epsilon there, and here."""
    cfg = _config(tmp_path, data, adam_eps=1e-9)
    assert "adam_eps" in cfg.unused and cfg.adam_epsilon is None
    assert any(n.startswith("adam_eps: not an Axolotl key") for n in cfg.notes), cfg.notes
    assert "adam_epsilon" not in trainer_arguments(cfg, "a", train_rows=20, eval_rows=0, dp=1)


def test_test_value_is_accepted_as_axolotl_drops_it(tmp_path, data):
    """`test_value: true` (llama-3/lora-1b-sample-packing-sequentially.yml) is read by no Axolotl code and dropped by
    its schema; accepted with one line, and the run's arguments are those without it."""
    cfg, plain = _config(tmp_path, data, test_value=True), _config(tmp_path, data)
    assert "test_value" in cfg.unused
    assert any(n.startswith("test_value: not an Axolotl key") for n in cfg.notes), cfg.notes
    assert trainer_arguments(cfg, "a", train_rows=20, eval_rows=0, dp=1) == trainer_arguments(
        plain, "a", train_rows=20, eval_rows=0, dp=1)


def test_bnb_optimizer_on_sharded_ranks_saves_model_only_checkpoints(tmp_path, data):
    """A bitsandbytes optimizer steps each rank's shards and its state cannot enter a sharded checkpoint
    (optimizer_8bit.refuse_checkpoint): Axolotl's qlora examples (paged_adamw_8bit, saves_per_epoch) trained and
    then stopped at their first checkpoint. Now their checkpoints hold the model only, with a note naming the fix;
    one rank, a torch optimizer or save_only_model already set keep the Trainer's full checkpoints."""
    from nd_parallel import ParallelismConfig
    from nd_parallel.cli.train.job import build_job

    keys = {"optimizer": "paged_adamw_8bit", "save_steps": 1, "max_steps": 2}
    two = ParallelismConfig(dp_shard_size=2).resolve(2)
    cfg = _config(tmp_path, data, **keys)
    job, _ = build_job(tmp_path / "c.yml", cfg, two, str(tmp_path / "w"))
    assert job.trainer_args["save_only_model"] is True
    assert any("paged_adamw_8bit on 2 sharded ranks" in n and "adamw_torch_8bit" in n for n in cfg.notes), cfg.notes
    one = ParallelismConfig().resolve(1)
    for layout, extra in ((one, {}), (two, {"optimizer": "adamw_torch"})):
        cfg = _config(tmp_path, data, **{**keys, **extra})
        job, _ = build_job(tmp_path / "c.yml", cfg, layout, str(tmp_path / "w"))
        assert "save_only_model" not in job.trainer_args and not cfg.notes, (layout, extra)


def test_empty_optimizer_and_scheduler_are_the_defaults(tmp_path, data):
    """`optimizer:` / `lr_scheduler:` with no value (None, as in Axolotl's replit example): Axolotl then uses the
    Trainer's AdamW and cosine; so does nd-parallel train, instead of refusing None."""
    cfg = _config(tmp_path, data, optimizer=None, lr_scheduler=None)
    assert (cfg.optimizer, cfg.lr_scheduler) == ("adamw_torch", "cosine")
    assert "optimizer='adafactor'" in _refusal(tmp_path, data, optimizer="adafactor")


def test_curriculum_sampling_trains_in_order(tmp_path, data):
    """curriculum_sampling: the Trainer's sequential sampler (Axolotl's SequentialSampler), not a shuffled one;
    sample_packing_sequentially is accepted (packing here is in sample order already). Parity under FSDP2 / TP2 / PP2
    / CP2: tests/distributed/test_train_yaml_parity.py (alpaca_lora)."""
    cfg = _config(tmp_path, data, curriculum_sampling=True, sample_packing=True, sample_packing_sequentially=True)
    args = trainer_arguments(cfg, "x", train_rows=40, eval_rows=0, dp=2)
    assert args["train_sampling_strategy"] == "sequential"
    assert "train_sampling_strategy" not in trainer_arguments(_config(tmp_path, data), "x", 40, 0, 2)


def test_a_micro_batch_the_pipeline_cannot_split_is_refused_before_the_ranks(tmp_path, data):
    """pipeline_parallel_size 2 splits each micro-batch into 2 pipeline micro-batches (pp_microbatches defaults to
    pp_size): micro_batch_size 1 was refused only on the ranks, at prepare; now in the job stage, with the fix."""
    with pytest.raises(ConfigError, match=r"micro_batch_size=1 cannot be split into pp_microbatches=2 .* multiple"):
        check_layout_rules(_config(tmp_path, data, micro_batch_size=1, pipeline_parallel_size=2), "c.yml")
    one = _config(tmp_path, data, micro_batch_size=1, pipeline_parallel_size=2, pp_microbatches=1)
    check_layout_rules(one, "c.yml")
    check_layout_rules(_config(tmp_path, data, micro_batch_size=4, pipeline_parallel_size=2), "c.yml")


def test_accelerator_config_sync_each_batch_is_read_and_the_rest_refused(tmp_path, data):
    """sync_each_batch only decides whether DDP skips its all-reduce while accumulating: FSDP2 here reduces every
    micro-batch (what true asks for), the same summed gradient either way; batch-splitting keys are refused."""
    cfg = _config(tmp_path, data, accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}})
    assert any("sync_each_batch" in note for note in cfg.notes)
    assert not [n for n in _config(tmp_path, data, accelerator_config={
        "gradient_accumulation_kwargs": {"sync_each_batch": False}}).notes if "sync_each_batch" in n]
    message = _refusal(tmp_path, data, accelerator_config={"split_batches": True, "gradient_accumulation_kwargs": {
        "num_steps": 4}})
    assert "accelerator_config.split_batches=True: nd_parallel splits and accumulates batches itself" in message
    assert "accelerator_config.gradient_accumulation_kwargs={'num_steps': 4}" in message
    assert "accelerator_config=3: write a mapping" in _refusal(tmp_path, data, accelerator_config=3)


@pytest.mark.parametrize("keys,match", [
    ({"save_strategy": "best", "val_set_size": 0.2}, r"save_strategy=best without metric_for_best_model \(Axolotl"),
    ({"save_strategy": "best", "metric_for_best_model": "loss"}, r"save_strategy=best without an evaluation: .*"
                                                                 r"set val_set_size"),
    ({"metric_for_best_model": "accuracy", "val_set_size": 0.2}, r"metric_for_best_model='accuracy': the "
                                                                 r"evaluation reports the loss only"),
    ({"greater_is_better": "yes"}, r"greater_is_better='yes'; use true or false"),
    ({"eval_strategy": "best"}, r"eval_strategy='best': use one of no, steps, epoch"),
])
def test_best_checkpoint_keys_refused_where_nothing_or_the_wrong_thing_would_be_saved(tmp_path, data, keys, match):
    assert re.search(match, _refusal(tmp_path, data, **keys))


def test_save_strategy_best_reaches_the_trainer(tmp_path, data):
    """save_strategy: best with metric_for_best_model / greater_is_better: the Trainer's arguments as Axolotl
    passes them (a checkpoint at each evaluation that improves the metric; test_axolotl_configs_train.py runs it)."""
    cfg = _config(tmp_path, data, save_strategy="best", metric_for_best_model="loss", greater_is_better=False,
                  val_set_size=0.2, eval_steps=1)
    args = trainer_arguments(cfg, "a", train_rows=20, eval_rows=5, dp=1)
    assert (args["save_strategy"], args["metric_for_best_model"], args["greater_is_better"]) == ("best", "loss", False)
    from transformers import TrainingArguments

    assert TrainingArguments(**args).save_strategy == "best"


def test_use_ray_starts_ray_num_workers_ranks(tmp_path, data):
    """Axolotl's use_ray with ray_num_workers (llama-3/lora-1b-ray.yml: ZeRO-3 json, 4 workers): the ranks are
    nd-parallel train's own, ray_num_workers of them unless --nproc is given (the same training), said in one line;
    a worker count that is not a count is refused."""
    from nd_parallel.cli.ranks import resolve_train_layout

    cfg = _config(tmp_path, data, use_ray=True, ray_num_workers=4, ray_run_name="r", dp_shard_size=-1)
    assert any(n.startswith("use_ray: nd-parallel train starts the ranks itself") for n in cfg.notes), cfg.notes
    config, nproc, _ = resolve_train_layout(cfg, "c.yml", None, cpu=True)
    assert (nproc, config.dp_shard_size) == (4, 4)
    cfg = _config(tmp_path, data, use_ray=True, ray_num_workers=4, dp_shard_size=-1)
    assert resolve_train_layout(cfg, "c.yml", 2, cpu=True)[1] == 2  # --nproc wins
    assert "ray_num_workers=0: write an integer >= 1" in _refusal(tmp_path, data, use_ray=True, ray_num_workers=0)
    notes = _config(tmp_path, data, use_ray=True, resources_per_worker={"GPU": 2}).notes
    assert any(n.startswith("resources_per_worker: Ray's per-worker resources") for n in notes), notes


@pytest.mark.parametrize("value,match", [
    ({"enabled": True, "every": 3}, "write a mapping of enabled, check_interval, trigger_file_path"),
    ({"enabled": True, "check_interval": 0}, "check_interval=0: write an integer >= 1"),
    ({"enabled": True, "trigger_file_path": "a/b.save"}, "write a file name"),
])
def test_dynamic_checkpoint_refusals(tmp_path, data, value, match):
    assert re.search(match, _refusal(tmp_path, data, dynamic_checkpoint=value))


def test_dynamic_checkpoint_callback_saves_when_the_file_appears(tmp_path, data):
    """One process: at a multiple of check_interval the file is consumed and control.should_save is set."""
    from types import SimpleNamespace

    from nd_parallel.cli.train.callbacks import watchdog
    from nd_parallel.cli.train.trigger_save import TriggerSave

    cfg = _config(tmp_path, data, dynamic_checkpoint={"enabled": True, "check_interval": 2,
                                                      "trigger_file_path": "now.save"})
    [callback] = [c for c in watchdog(cfg) if isinstance(c, TriggerSave)]
    args, control = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(should_save=False)
    (tmp_path / "now.save").touch()
    for step, saves in ((1, False), (2, True)):
        control.should_save = False
        callback.on_step_end(args, SimpleNamespace(global_step=step, is_world_process_zero=True), control)
        assert control.should_save is saves
    assert not (tmp_path / "now.save").exists()
    assert watchdog(_config(tmp_path, data, dynamic_checkpoint={"enabled": False})) == []
