"""Axolotl's learning-rate schedules beyond transformers' own: `cosine_constant_lr_ratio` (its cosine to a floor with
a constant tail) and `lr_scheduler: rex` equal Axolotl's own schedulers run in its venv, bit for bit; `one_cycle` and
transformers' named schedules reach the rank's Trainer; the combinations Axolotl ignores silently are refused."""

import json
import re

import pytest
import torch

from nd_parallel.cli.train.job import trainer_arguments
from tests.distributed.train_yaml_helpers import write_model_and_data
from tests.unit.axolotl_venv import run_in_axolotl
from tests.unit.test_axolotl_trainer_keys import _config, _lrs, _optimizer, _refusal


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_model_and_data(tmp_path_factory.mktemp("schedules"), n=20)


_AXOLOTL_TAIL = """
import json, sys, torch
from axolotl.utils.schedulers import get_cosine_schedule_with_warmup_decay_constant as build
out = {}
for case in json.loads(sys.argv[1]):
    warmup, total, constant, floor = case
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = build(opt, num_warmup_steps=warmup, num_training_steps=total, constant_lr_ratio=constant,
                  min_lr_ratio=floor)
    lrs = []
    for _ in range(total):
        lrs.append(sched.get_last_lr()[0]); opt.step(); sched.step()
    out[str(case)] = lrs
print(json.dumps(out))
"""
TAILS = [[2, 10, 0.8, 0.1], [0, 7, 0.5, 0.25], [3, 12, 1.0, 0.1], [1, 9, 0.3, 0.5]]


def test_constant_tail_equals_axolotls_scheduler():
    """cosine_constant_lr_ratio: Axolotl 0.19's get_cosine_schedule_with_warmup_decay_constant, run in its venv: the
    same learning rates bit for bit (warm-up, the cosine to the floor, then the floor)."""

    from nd_parallel.cli.train.schedules import cosine_with_constant_tail

    theirs = run_in_axolotl("-c", _AXOLOTL_TAIL, json.dumps(TAILS), timeout=600)
    for warmup, total, constant, floor in TAILS:
        ours = _lrs(cosine_with_constant_tail(_optimizer(), warmup, total, constant, floor), total)
        assert ours == theirs[str([warmup, total, constant, floor])]
        tail = ours[int(total * constant):]
        assert (tail or constant == 1) and all(lr == pytest.approx(0.1 * floor, rel=1e-12) for lr in tail)


def test_the_trainer_builds_the_constant_tail(tmp_path, data):
    """The YAML keys reach the rank's Trainer: create_scheduler builds the constant tail with the Trainer's warm-up
    count, over cosine_min_lr_ratio's TrainingArguments."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from nd_parallel.cli.train.schedules import cosine_with_constant_tail, use_constant_tail

    cfg = _config(tmp_path, data, cosine_min_lr_ratio=0.1, cosine_constant_lr_ratio=0.6, warmup_steps=2,
                  max_steps=10, learning_rate=0.1)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32),
                      args=TrainingArguments(**trainer_arguments(cfg, "t", train_rows=20, eval_rows=0, dp=1)))
    use_constant_tail(trainer, cfg.cosine_constant_lr_ratio, cfg.cosine_min_lr_ratio)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    want = _lrs(cosine_with_constant_tail(_optimizer(0.1), 2, 10, 0.6, 0.1), 10)
    assert _lrs(trainer.lr_scheduler, 10) == pytest.approx(want, rel=1e-12)
    assert want[6:] == pytest.approx([0.01] * 4, rel=1e-12)


@pytest.mark.parametrize("keys,match", [
    ({"cosine_constant_lr_ratio": 0.8}, r"cosine_min_lr_ratio=None: the constant tail belongs"),
    ({"cosine_constant_lr_ratio": 0.8, "cosine_min_lr_ratio": 0.1, "lr_scheduler": "linear"}, "lr_scheduler='linear'"),
    ({"cosine_constant_lr_ratio": 1.5, "cosine_min_lr_ratio": 0.1}, "write a number between 0 and 1"),
])
def test_constant_tail_refusals(tmp_path, data, keys, match):
    assert re.search(match, _refusal(tmp_path, data, **keys))


_AXOLOTL_REX = """
import json, sys, torch
from axolotl.utils.schedulers import RexLR
out = {}
for case in json.loads(sys.argv[1]):
    warmup, total, floor = case
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = RexLR(opt, max_lr=0.1, min_lr=0.1 * floor, total_steps=total, num_warmup_steps=warmup)
    lrs = []
    for _ in range(total):
        lrs.append(sched.get_last_lr()[0]); opt.step(); sched.step()
    out[str(case)] = lrs
print(json.dumps(out))
"""
REX = [[0, 10, 0.0], [3, 12, 0.1], [2, 5, 0.5]]


def test_rex_equals_axolotls_scheduler():
    """lr_scheduler: rex: Axolotl 0.19's RexLR, run in its venv: the same learning rates, bit for bit."""

    from nd_parallel.cli.train.schedules import Rex

    theirs = run_in_axolotl("-c", _AXOLOTL_REX, json.dumps(REX), timeout=600)
    for warmup, total, floor in REX:
        assert _lrs(Rex(_optimizer(), 0.1, 0.1 * floor, total, warmup), total) == theirs[str([warmup, total, floor])]


@pytest.mark.parametrize("kind,keys", [("rex", {"cosine_min_lr_ratio": 0.1}), ("one_cycle", {}),
                                       ("cosine_with_restarts", {"lr_scheduler_kwargs": {"num_cycles": 2}})])
def test_the_trainer_builds_the_named_schedule(tmp_path, data, kind, keys):
    """rex / one_cycle: "cosine" in TrainingArguments and Axolotl's scheduler from create_scheduler (OneCycleLR with
    pct_start the warm-up's share, cosine annealing); transformers' own schedules reach TrainingArguments."""
    from torch.optim.lr_scheduler import OneCycleLR
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from nd_parallel.cli.train.schedules import Rex, use_alternate

    cfg = _config(tmp_path, data, lr_scheduler=kind, warmup_steps=2, max_steps=10, learning_rate=0.1, **keys)
    args = trainer_arguments(cfg, "k", train_rows=20, eval_rows=0, dp=1)
    assert args["lr_scheduler_type"] == ("cosine" if kind in ("rex", "one_cycle") else kind)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32),
                      args=TrainingArguments(**args))
    if kind in ("rex", "one_cycle"):
        use_alternate(trainer, cfg)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    scheduler = trainer.lr_scheduler
    if kind == "rex":
        assert isinstance(scheduler, Rex) and scheduler.min_lr == pytest.approx(0.01)
    elif kind == "one_cycle":
        assert isinstance(scheduler, OneCycleLR) and scheduler.total_steps == 10
    assert "lr_scheduler='cosine_with_min_lr' without lr_scheduler_kwargs" in _refusal(
        tmp_path, data, lr_scheduler="cosine_with_min_lr")
