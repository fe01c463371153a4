"""Axolotl's model_type: MambaLMHeadModel (examples/mamba): a checkpoint in mamba_ssm's format becomes transformers'
MambaForCausalLM with the same weights (models/mamba_ssm_checkpoint.py): the converted model computes the same
logits as the network it was written from; what cannot convert is refused in the config stage."""

import json

import pytest
import torch

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from nd_parallel.models import mamba_ssm_checkpoint as mamba
from nd_parallel.testing.models import write_mamba_ssm


@pytest.fixture
def tiny_mamba(tmp_path):
    from nd_parallel.testing.models import save_tiny_model

    return str(save_tiny_model("mamba", tmp_path / "mamba", seed=1))


def test_the_converted_checkpoint_computes_what_the_network_computed(tiny_mamba, tmp_path):
    from transformers import AutoModelForCausalLM

    original = write_mamba_ssm(tiny_mamba, tmp_path / "ssm")
    assert mamba.is_mamba_ssm(tmp_path / "ssm") and not mamba.problems(tmp_path / "ssm")
    converted = AutoModelForCausalLM.from_pretrained(mamba.convert(tmp_path / "ssm", tmp_path / "hf"))
    assert type(converted).__name__ == "MambaForCausalLM"
    assert converted.config.vocab_size == original.config.vocab_size  # padded as mamba_ssm pads it
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, rtol=0, atol=0)
    assert mamba.convert(tmp_path / "ssm", tmp_path / "hf") == str(tmp_path / "hf")  # reused while complete


def test_what_cannot_convert_is_refused_in_the_config_stage(tiny_mamba, tmp_path):
    write_mamba_ssm(tiny_mamba, tmp_path / "ssm")
    config = json.loads((tmp_path / "ssm" / "config.json").read_text())
    config["rms_norm"], config["ssm_cfg"]["layer"] = False, "Mamba2"
    (tmp_path / "ssm" / "config.json").write_text(json.dumps(config))
    (tmp_path / "c.yml").write_text(json.dumps({
        "base_model": str(tmp_path / "ssm"), "model_type": "MambaLMHeadModel", "tokenizer_config": tiny_mamba,
        "datasets": [{"path": "d.jsonl", "type": "alpaca"}]}))
    with pytest.raises(ConfigError) as err:
        load_train_config(tmp_path / "c.yml", environ={})
    for needle in ("ssm_cfg.layer='Mamba2': a Mamba-2 checkpoint", "rms_norm: false"):
        assert needle in str(err.value), (needle, str(err.value))
