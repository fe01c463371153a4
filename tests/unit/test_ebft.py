"""rl: ebft's feature-matching reward (cli/train/ebft.py) equals Axolotl 0.19's own code (in its venv) on the same
tensors: the four poolings, and the rewards and CFM loss with and without whitening; plus the config stage."""

import json
from pathlib import Path

import pytest
import torch

from nd_parallel.cli.train import ebft
from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from tests.unit.axolotl_venv import run_in_axolotl


def test_the_reward_equals_axolotls(tmp_path):
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(6, 9, dtype=torch.long)
    for row, length in enumerate((9, 7, 5, 8, 6, 9)):
        mask[row, length:] = 0  # right padding
    spec = {"hidden": torch.randn(6, 9, 12, generator=g), "mask": mask,
            "prompt_lengths": torch.tensor([3, 2, 1, 4, 2, 3]), "generated": torch.randn(6, 12, generator=g),
            "truth": torch.randn(2, 12, generator=g), "groups": 3}
    torch.save(spec, tmp_path / "spec.pt")
    run_in_axolotl(str(Path(__file__).with_name("axolotl_ebft_dump.py")), str(tmp_path / "spec.pt"),
                   str(tmp_path / "out.pt"))
    theirs = torch.load(tmp_path / "out.pt")
    for method in ebft.EMBED_METHODS:
        ours = ebft.pool(spec["hidden"], method, spec["mask"], spec["prompt_lengths"])
        torch.testing.assert_close(ours, theirs[f"pool_{method}"], rtol=1e-6, atol=1e-6, msg=method)
    for whitening in (False, True):
        block = ebft.settings({"use_whitening": whitening, "diversity_coef": 0.5})
        rewards, _, _, cfm = ebft.feature_rewards(spec["generated"], spec["truth"], 3, block)
        torch.testing.assert_close(rewards, theirs[f"rewards_{whitening}"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cfm, theirs[f"cfm_{whitening}"], rtol=1e-5, atol=1e-5)


def test_ebft_config_stage(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"input": "q", "output": "a"}) + "\n")
    base = {"base_model": "./m", "rl": "ebft", "micro_batch_size": 2, "sequence_len": 64,
            "datasets": [{"path": str(tmp_path / "d.jsonl"), "type": "ebft_opencode.transform"}],
            "trl": {"num_generations": 2, "use_vllm": True, "vllm_server_port": 8000,
                    "generation_kwargs": {"stop_token_ids": [5], "frequency_penalty": 0.1}}}
    (tmp_path / "c.yml").write_text(json.dumps(base))
    cfg = load_train_config(tmp_path / "c.yml", environ={})
    notes = "\n".join(cfg.notes)
    for needle in ("trl.use_vllm: vLLM generates from a CUDA server", "generation_kwargs.frequency_penalty: a vLLM"):
        assert needle in notes, (needle, notes)
    bad = {**base, "ebft": {"mode": "striped", "embed_method": "max", "feature_layers": [2], "stride_len": 3}}
    (tmp_path / "c.yml").write_text(json.dumps(bad))
    with pytest.raises(ConfigError) as err:
        load_train_config(tmp_path / "c.yml", environ={})
    for needle in ("ebft.mode='striped'", "ebft.embed_method='max'", "ebft.feature_layers=[2]",
                   "unknown key ebft.stride_len"):
        assert needle in str(err.value), (needle, str(err.value))


def test_each_rank_holds_whole_groups(tmp_path):
    from nd_parallel.cli.train.grpo import batch_problem

    (tmp_path / "c.yml").write_text(json.dumps({
        "base_model": "./m", "rl": "ebft", "micro_batch_size": 1, "gradient_accumulation_steps": 1,
        "datasets": [{"path": "d.jsonl", "type": "ebft_opencode.transform"}], "trl": {"num_generations": 2}}))
    cfg = load_train_config(tmp_path / "c.yml", environ={})
    assert "rl: ebft scores each prompt group on one rank" in batch_problem(cfg, dp=2)
    cfg.gradient_accumulation_steps = 2
    assert batch_problem(cfg, dp=2) is None
