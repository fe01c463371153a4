"""Axolotl's dpo_* keys (cli/train/preference.py): read into DPOConfig as Axolotl's DPOStrategy passes them, refused
with the reason where TRL cannot run them or where they belong to another trainer."""

import json

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.preference import dpo_args
from nd_parallel.config import ConfigError


def _load(tmp_path, **keys):
    (tmp_path / "c.yml").write_text(json.dumps({"base_model": "./m", "datasets": [
        {"path": "d.jsonl", "type": "chatml.prompt_pairs"}], **keys}))
    return load_train_config(tmp_path / "c.yml", environ={})


def test_dpo_keys_reach_dpoconfig(tmp_path):
    cfg = _load(tmp_path, rl="dpo", dpo_loss_type=["sigmoid", "sft"], dpo_loss_weights=[1, 0.5],
                dpo_label_smoothing="1e-1", dpo_use_liger_kernel=True)
    assert dpo_args(cfg) == {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "label_smoothing": 0.1}
    notes = "\n".join(cfg.notes)
    assert "Liger's fused DPO loss" in notes and "averages the SFT term over each micro-batch" in notes, notes
    assert dpo_args(_load(tmp_path, rl="ipo", dpo_use_weighting=True)) == {"loss_type": ["ipo"], "use_weighting": True}


def test_bad_dpo_keys_are_refused_together(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, rl="dpo", dpo_loss_type=["sigmoid", "hinge", "nope"], dpo_loss_weights=[1.0],
              dpo_label_smoothing=0.7, dpo_use_weighting=True)
    for needle in ("dpo_loss_type=['sigmoid', 'hinge', 'nope']: use one of", "dpo_loss_weights=[1.0]: write one",
                   "dpo_label_smoothing=0.7", "dpo_use_weighting with dpo_loss_type ['hinge', 'nope']"):
        assert needle in str(err.value), (needle, str(err.value))
    with pytest.raises(ConfigError, match="dpo_loss_type with rl: kto: a DPOTrainer setting"):
        _load(tmp_path, rl="kto", micro_batch_size=2, dpo_loss_type="sigmoid",
              datasets=[{"path": "d.jsonl", "type": "chatml.intel"}])
