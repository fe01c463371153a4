"""`trainer_cls` (cli/train/trainer_class.py) through `nd-parallel train`: a transformers.Trainer subclass from the
YAML's folder whose create_optimizer builds SGD with momentum trains under FSDP2 and DDP exactly as in one process
(every loss, every saved tensor), and differs from the same YAML without it (AdamW). A class that is not a Trainer,
or one that does not import, is refused before any rank starts. Tolerance: fp32 reduction order only."""

import pytest

from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import (
    compare_runs,
    jobs_for,
    run_rows,
    saved_tensors,
    write_model_and_data,
    write_yaml,
)

MODULE = '''
import torch
from transformers import Trainer


class SGDTrainer(Trainer):
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
            self.optimizer = torch.optim.SGD(params, lr=self.args.learning_rate, momentum=0.9)
        return self.optimizer


class NotATrainer:
    pass
'''
BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=0.05, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", sequence_len=64, val_set_size=0.0, trainer_cls="sgd_trainer.SGDTrainer")
LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_cls")
    (root / "sgd_trainer.py").write_text(MODULE)  # the YAMLs' folder: imported from there
    data = write_model_and_data(root, n=48)
    row = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
           "datasets": [{"path": data["text"], "type": "completion"}]}
    return run_rows(root, {"sgd": row}, LAYOUTS, {"micro_batch_size": 4}, {"sgd": {"trainer_cls": None}}), data


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_users_trainer_matches_one_process(runs, layout):
    root, _ = runs
    compare_runs(root / f"sgd_{layout}", root / "sgd_ref", rtol=1e-5, atol=1e-5, label=f"trainer_cls {layout}")


def test_the_users_trainer_is_the_one_that_trained(runs):
    root, _ = runs
    got, plain = saved_tensors(root / "sgd_ref"), saved_tensors(root / "sgd_plain")
    assert max((got[k] - plain[k]).abs().max().item() for k in got) > 1e-4  # SGD, not the YAML's AdamW


@pytest.mark.parametrize("name,match", [("sgd_trainer.NotATrainer", "is not a transformers.Trainer subclass"),
                                        ("missing_module.Trainer", "No module named 'missing_module'")])
def test_a_bad_class_is_refused_before_any_rank(runs, tmp_path, name, match):
    root, data = runs
    path = write_yaml(root / f"bad_{name.split('.')[0]}.yaml", {
        "base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}],
        "output_dir": str(tmp_path / "o"), "trainer_cls": name})
    with pytest.raises(ConfigError, match=f"trainer_cls='{name}' cannot be used: .*{match}"):
        jobs_for([path], tmp_path, 1)
