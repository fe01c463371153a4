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


def test_precompute_ref_log_probs_is_the_per_step_reference_without_dropout(tmp_path):
    """TRL's precomputed reference runs in eval mode before training; the per-step one here runs in train mode: the
    same values exactly when no dropout acts, so a model with dropout is refused (LoRA's own dropout is off in the
    reference). Without rl, or with orpo (no reference), the key is refused."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.cli.train.preference import check_precompute
    from nd_parallel.testing.models import save_tiny_model

    cfg = _load(tmp_path, rl="dpo", precompute_ref_log_probs=True)
    llama = AutoModelForCausalLM.from_pretrained(save_tiny_model("llama", tmp_path / "llama", seed=0))
    check_precompute(cfg, llama)  # no dropout: accepted
    gpt2 = AutoModelForCausalLM.from_pretrained(save_tiny_model("gpt2", tmp_path / "gpt2", seed=0))
    with pytest.raises(ConfigError, match=r"applies dropout in training \(transformer.*drop.*load the model"):
        check_precompute(cfg, gpt2)
    with pytest.raises(ConfigError, match="precompute_ref_log_probs without rl"):
        _load(tmp_path, precompute_ref_log_probs=True)
    with pytest.raises(ConfigError, match="precompute_ref_log_probs with rl: orpo: that trainer has no reference"):
        _load(tmp_path, rl="orpo", precompute_ref_log_probs=True)
    notes = _load(tmp_path, rl="dpo", dpo_padding_free=True).notes
    assert any(n.startswith("dpo_padding_free: TRL turns padding_free off") for n in notes), notes


def test_simpo_keys(tmp_path):
    """rl: simpo (TRL's CPOTrainer, loss_type simpo): simpo_gamma required (Axolotl passes it unset and TRL's loss
    fails), cpo_alpha optional; both refused with another rl; PP refused (the loss needs the whole logits)."""
    cfg = _load(tmp_path, rl="simpo", simpo_gamma=0.5, cpo_alpha=0)
    assert (cfg.rl, cfg.simpo_gamma, cfg.cpo_alpha) == ("simpo", 0.5, 0)
    with pytest.raises(ConfigError, match="rl: simpo without simpo_gamma: Axolotl passes it unset"):
        _load(tmp_path, rl="simpo")
    with pytest.raises(ConfigError, match="simpo_gamma with rl: dpo: a SimPO"):
        _load(tmp_path, rl="dpo", simpo_gamma=0.5)
    with pytest.raises(ConfigError, match="rl: simpo with pipeline_parallel_size: 2: SIMPO builds its loss"):
        _load(tmp_path, rl="simpo", simpo_gamma=0.5, pipeline_parallel_size=2)
