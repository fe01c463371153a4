"""scaling_softmax (SSMax; nd_parallel/models/ssmax.py, cli/train/attention_options.py): the model's logits with
SSMax-scaled queries equal Axolotl 0.19's own FlexAttention patch (run in its venv, on the same weights), with SDPA
and eager alike; it applies with flex_attention only (Axolotl's meaning), one line otherwise; refused under CP."""

import json

import pytest
import torch

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from nd_parallel.models import ssmax
from tests.distributed.train_yaml_helpers import write_yaml
from tests.unit.axolotl_venv import run_in_axolotl

_AXOLOTL = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from axolotl.monkeypatch.scaled_softmax_attn import patch_scaled_softmax_attention
path, ids, s, b = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="flex_attention")
patch_scaled_softmax_attention(scaling_factor_init=s, bias=b, model=m)
with torch.no_grad():
    print(json.dumps(m(torch.tensor(ids)).logits.tolist()))
"""


@pytest.mark.parametrize("family,s,b", [("llama", 0.43, 0.0), ("qwen3", 0.6, 0.2)])
def test_logits_equal_axolotls_flex_patch(tmp_path, family, s, b):
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import save_tiny_model

    path = save_tiny_model(family, tmp_path / "m", seed=0)
    ids = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    theirs = torch.tensor(run_in_axolotl("-c", _AXOLOTL, str(path), json.dumps(ids.tolist()), str(s), str(b),
                                         timeout=600))
    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl)
        with torch.no_grad():
            plain = model(ids).logits
            ssmax.install(model, s, b)
            ours = model(ids).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        assert (ours - plain).abs().max() > 1e-3  # the scaling changes the model's output


def test_factors_follow_the_paper():
    got = ssmax.factors(torch.tensor([0, 1, 2, 9]), s=0.5, b=0.1)
    want = torch.tensor([0.5 * torch.log(torch.tensor(2.0)) + 0.1] * 2 + [0.5 * torch.log(torch.tensor(3.0)) + 0.1,
                                                                           0.5 * torch.log(torch.tensor(10.0)) + 0.1])
    torch.testing.assert_close(got, want)


def test_it_applies_with_flex_attention_only(tmp_path):
    base = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}], "scaling_softmax": True}
    cfg = load_train_config(write_yaml(tmp_path / "a.yml", {**base, "attn_implementation": "flex_attention"}),
                            environ={})
    assert cfg.scaling_softmax is True
    cfg = load_train_config(write_yaml(tmp_path / "b.yml", {**base, "attn_implementation": "sdpa"}), environ={})
    assert cfg.scaling_softmax is False
    assert any(n.startswith("scaling_softmax: Axolotl 0.19 applies") for n in cfg.notes)
    with pytest.raises(ConfigError, match="scaling_softmax with context_parallel_size=2: the ring attention"):
        load_train_config(write_yaml(tmp_path / "c.yml", {**base, "attn_implementation": "flex_attention",
                                                          "context_parallel_size": 2}), environ={})
