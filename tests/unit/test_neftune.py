"""NEFTune (cli/train/neftune.py): transformers' noise scale alpha / sqrt(L x d), uniform, in training only, each row's
noise keyed by (seed, step, its tokens): the same row gets the same noise alone or in any batch."""

import math
from types import SimpleNamespace

import pytest
import torch

from nd_parallel.cli.train.neftune import KeyedNEFTune


def test_keyed_noise_has_neftunes_scale_and_follows_the_row():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(50, 16)
    model.get_input_embeddings = lambda: model.embed
    noise = KeyedNEFTune(model, alpha=5.0, seed=0)
    ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    clean = model.embed.weight[ids].detach()
    noisy = model.embed(ids).detach()
    bound = 5.0 / math.sqrt(10 * 16)
    assert (noisy - clean).abs().max() <= bound and (noisy - clean).abs().max() > 0.9 * bound
    assert torch.equal(model.embed(ids[1:2]).detach(), noisy[1:2])  # the row alone: the same noise
    noise.on_step_begin(None, SimpleNamespace(global_step=1), None)
    assert not torch.equal(model.embed(ids).detach(), noisy)  # another step, other noise
    model.embed.eval()
    assert torch.equal(model.embed(ids).detach(), clean)  # no noise in evaluation


def test_neftune_config(tmp_path):
    import json

    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.objective import check_dora_layout
    from nd_parallel.config import ConfigError, ParallelismConfig

    base = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
    (tmp_path / "c.yml").write_text(json.dumps({**base, "noisy_embedding_alpha": "5e0"}))
    cfg = load_train_config(tmp_path / "c.yml", environ={})
    assert cfg.neftune_noise_alpha == 5.0
    with pytest.raises(ConfigError, match="neftune_noise_alpha with tensor / context parallelism"):
        check_dora_layout(cfg, ParallelismConfig(cp_size=2), "c.yml")
    (tmp_path / "c.yml").write_text(json.dumps({**base, "noisy_embedding_alpha": 5, "neftune_noise_alpha": 5}))
    with pytest.raises(ConfigError, match="both set"):
        load_train_config(tmp_path / "c.yml", environ={})
