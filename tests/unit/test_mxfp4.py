"""gpt-oss's MXFP4 checkpoints, dequantized at load (model_quantization_config: Mxfp4Config, dequantize: true), in one
process: the packer writes the format transformers reads (FP4 E2M1 codes two to a byte, 32-value blocks with an
E8M0 scale), the dequantized model equals the tiny model with its expert weights on the FP4 grid exactly, on CPU,
through the ranks' own loading code; the config mapping; everything else refused with the fix."""

import json

import pytest
import torch

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from nd_parallel.testing.models import save_tiny_model
from nd_parallel.testing.mxfp4 import pack, save_mxfp4_checkpoint, to_fp4_grid, unpack
from tests.distributed.train_yaml_helpers import write_yaml

MXFP4 = {"model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": True}}


def test_the_packed_bytes_follow_the_format():
    """One block of 32 values of gpt-oss' layout ([experts, in, out], blocks cut along in): scale byte 127 + e with
    the largest value in [4, 8) x 2^e, the even value in the low nibble, the sign in bit 3."""
    column = torch.tensor([1.0, -0.5, 6.0, 0.0] + [0.0] * 28) * 2.0 ** -3  # amax 0.75: e = floor(log2 .75) - 2 = -3
    blocks, scales = pack(column.reshape(1, 32, 1))
    assert blocks.shape == (1, 1, 1, 16) and scales.shape == (1, 1, 1)
    assert scales.item() == 127 - 3
    assert blocks[0, 0, 0, 0].item() == 0x2 | (0x8 | 0x1) << 4  # 1.0 (code 2), then -0.5 (sign | code 1)
    assert blocks[0, 0, 0, 1].item() == 0x7  # 6.0 (code 7), then 0.0
    assert torch.equal(unpack(blocks, scales), column.reshape(1, 32, 1))


def test_unpack_is_transformers_dequantizer_and_grid_values_round_trip():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    weight = torch.randn(3, 64, 96) * 0.05
    weight[0, :32, 0] = 0.0  # an all-zero block
    blocks, scales = pack(weight)
    assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(unpack(blocks, scales), theirs)
    grid = to_fp4_grid(weight)
    assert torch.equal(unpack(*pack(grid)), grid)  # exact for values on the grid
    assert (grid - weight).abs().max() <= weight.abs().max() / 4  # and near the weight (2 mantissa bits)
    with pytest.raises(ValueError, match=r"divisible by 32, got 48 .*multiples of 32"):
        pack(torch.zeros(1, 48, 4))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    plain = save_tiny_model("gpt_oss", root / "plain", seed=1, num_local_experts=4, num_experts_per_tok=2)
    on_grid = save_mxfp4_checkpoint(plain, root / "mxfp4")
    return plain, root / "mxfp4", on_grid


def test_the_checkpoint_is_in_mxfp4_form(checkpoints):
    from safetensors import safe_open

    _, packed, on_grid = checkpoints
    config = json.loads((packed / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert sorted(on_grid) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
                               "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    for key in on_grid:
        assert {f"{key}_blocks", f"{key}_scales"} <= keys and key not in keys
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in keys  # the biases stay in full precision


def test_dequantized_load_on_cpu_equals_the_grid_model(checkpoints):
    """transformers' own loader with Mxfp4Config(dequantize=True) in fp32 on CPU: exactly the plain model with its
    expert weights on the FP4 grid; a plain model afterwards (no quantizer, no quantization config)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    plain, packed, on_grid = checkpoints
    model = AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    assert not getattr(model, "is_quantized", False) and not hasattr(model.config, "quantization_config")
    expected = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).state_dict()
    expected.update(on_grid)
    got = model.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], value), key


def test_the_yaml_keys_reach_the_ranks_loader(checkpoints, tmp_path):
    """load_train_config -> TrainConfig -> the ranks' _model (rank.py): the experts read from the blocks."""
    from transformers import PreTrainedTokenizerFast

    from nd_parallel.cli.train.rank import _model

    _, packed, on_grid = checkpoints
    path = write_yaml(tmp_path / "c.yml", {"base_model": str(packed), "datasets": [{"path": "d.jsonl",
                                                                                  "type": "completion"}], **MXFP4})
    cfg = load_train_config(path, environ={})
    assert cfg.model_quantization_config == "Mxfp4Config" and cfg.model_quantization_config_kwargs == {
        "dequantize": True}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_tiny_bpe())
    state = _model(cfg, tokenizer).state_dict()
    for key, value in on_grid.items():
        assert torch.equal(state[key], value), key


def _tiny_bpe():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))


@pytest.mark.parametrize("keys,match", [
    ({"model_quantization_config": "Mxfp4Config"},
     r"Mxfp4Config without dequantize: true keeps the experts in MXFP4 .*add model_quantization_config_kwargs: "
     r"\{dequantize: true\}"),
    ({**MXFP4, "model_quantization_config_kwargs": {"dequantize": False}}, r"without dequantize: true"),
    ({"model_quantization_config": "FineGrainedFP8Config"}, r"FP8 checkpoints are not loaded .*bf16 checkpoint"),
    ({"model_quantization_config": "BitsAndBytesConfig"},
     r"Axolotl knows Mxfp4Config and FineGrainedFP8Config; write Mxfp4Config with .*dequantize: true"),
    ({"model_quantization_config_kwargs": {"dequantize": True}}, r"without model_quantization_config"),
    ({**MXFP4, "model_quantization_config_kwargs": "dequantize"}, r"write a mapping, e\.g\. \{dequantize: true\}"),
    ({**MXFP4, "model_quantization_config_kwargs": {"dequantize": True, "group_size": 32}},
     r"model_quantization_config_kwargs\.group_size: not an argument of Mxfp4Config"),
    ({**MXFP4, "load_in_4bit": True, "adapter": "qlora"}, r"model_quantization_config with load_in_4bit: .*drop"),
])
def test_other_quantization_configs_are_refused_with_the_fix(tmp_path, keys, match):
    path = write_yaml(tmp_path / "c.yml", {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}],
                                           **keys})
    with pytest.raises(ConfigError, match=match):
        load_train_config(path, environ={})


def test_memory_efficient_loading_falls_back_to_the_plain_path(checkpoints, caplog):
    """plugin.from_pretrained: the meta-device path cannot read blocks into expert weights slice by slice, so it
    falls back to transformers' loader with a warning (the checkpoint's own quantization_config, or one passed),
    instead of reporting the experts missing."""
    import logging

    from transformers import Mxfp4Config

    from nd_parallel import NDParallelPlugin
    from nd_parallel.models.loading import lazy_checkpoint

    _, packed, on_grid = checkpoints
    plugin = NDParallelPlugin(dp_shard_size=2)
    for kwargs in ({"quantization_config": Mxfp4Config(dequantize=True)}, {}):
        with caplog.at_level(logging.WARNING, logger="nd_parallel"):
            model = plugin.from_pretrained(packed, dtype=torch.float32, **kwargs)
        assert "memory-efficient loading does not apply (a quantization_config (mxfp4)" in caplog.text
        assert lazy_checkpoint(model) is None
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in on_grid.items())
