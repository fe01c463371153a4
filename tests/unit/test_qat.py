"""Quantization-aware training (models/qat.py, Axolotl's ``qat:``), in one process: Axolotl's example values parse
and the invalid ones are refused with the fix; the swap keeps parameter names, objects and ties; the fake quantizers
change the forward (every format), ``set_fake_quant`` / ``fake_quant_after_n_steps`` switch them, ``convert_qat``
undoes the swap; TP is refused before any collective; nd-parallel train's callback and config stage."""

import pytest
import torch

from nd_parallel.config import ConfigError, ParallelismConfig

pytest.importorskip("torchao")

from nd_parallel.models.qat import QATOptions, check_qat_layout, convert_qat, prepare_qat, set_fake_quant  # noqa: E402

# the three value sets of Axolotl's examples, and the other valid pairs
EXAMPLES = [{"activation_dtype": "int8", "weight_dtype": "int4", "group_size": 32, "fake_quant_after_n_steps": 1000},
            {"activation_dtype": "mxfp4", "weight_dtype": "mxfp4", "group_size": 32},
            {"activation_dtype": "nvfp4", "weight_dtype": "nvfp4", "group_size": 16},
            {"weight_dtype": "int4", "group_size": 16, "quantize_embedding": True},
            {"activation_dtype": "fp8", "weight_dtype": "float8_e4m3fn"},
            {"activation_dtype": "float8", "weight_dtype": "int4"}]


def _model(family="llama"):
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa")


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("value", EXAMPLES, ids=lambda v: f"{v.get('activation_dtype')}-{v['weight_dtype']}")
def test_fake_quant_changes_the_forward_and_keeps_the_parameters(value):
    model = _model()
    ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = _loss(model, ids)
    params = dict(model.named_parameters())
    swapped = prepare_qat(model, value)
    assert "lm_head" in swapped and len(swapped) == 2 * 7 + 1 + bool(value.get("quantize_embedding"))
    assert dict(model.named_parameters()) == params  # same names, same Parameter objects (optimizer, checkpoints)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives
    set_fake_quant(model, True)
    loss = _loss(model, ids)
    assert not torch.equal(loss.detach(), plain), value  # the fake quantizers act
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "proj" in n)
    assert set_fake_quant(model, False) == len(swapped)
    with torch.no_grad():
        assert torch.equal(_loss(model, ids), plain)  # off: the full-precision forward, bit for bit
    assert convert_qat(model) == len(swapped) and type(model.lm_head) is torch.nn.Linear
    assert dict(model.named_parameters()) == params


def test_fake_quant_after_n_steps_starts_off():
    model = _model()
    ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = _loss(model, ids)
        prepare_qat(model, EXAMPLES[0])  # fake_quant_after_n_steps: 1000
        assert torch.equal(_loss(model, ids), plain)
        set_fake_quant(model, True)
        assert not torch.equal(_loss(model, ids), plain)


def test_the_train_callback_switches_at_step_n():
    from types import SimpleNamespace

    from nd_parallel.cli.train.callbacks import fake_quant_after

    model = _model()
    prepare_qat(model, {"weight_dtype": "int4", "group_size": 32, "fake_quant_after_n_steps": 2})
    (callback,) = fake_quant_after(SimpleNamespace(qat={"fake_quant_after_n_steps": 2}))
    states = []
    for step in (0, 1, 2, 3, 1):  # the last: a run resumed before n is off again
        callback.on_step_begin(None, SimpleNamespace(global_step=step), None, model=model)
        states.append(model.lm_head.weight_fake_quantizer.enabled)
    assert states == [False, False, True, True, False]
    assert fake_quant_after(SimpleNamespace(qat=None)) == []


@pytest.mark.parametrize("value, needle", [
    ({"activation_dtype": "int8", "weight_dtype": "int8"}, "none/int4, float8/float8"),
    ({"weight_dtype": "int8"}, "activation_dtype=None with weight_dtype='int8'"),  # Axolotl's default weight dtype
    ({"activation_dtype": "nvfp4", "weight_dtype": "nvfp4", "group_size": 32}, "set group_size: 16"),
    ({"activation_dtype": "mxfp4", "weight_dtype": "mxfp4", "group_size": 16}, "set group_size: 32"),
    ({"weight_dtype": "int3"}, "weight_dtype='int3'; use one of int4, int8"),
    ({"weight_dtype": "int4", "group": 32}, "unknown key(s) 'group'"),
    ({"weight_dtype": "int4", "fake_quant_after_n_steps": -1}, "fake_quant_after_n_steps=-1"),
    ("int4", "write a mapping")])
def test_invalid_values_are_refused_with_the_fix(value, needle):
    with pytest.raises(ConfigError) as err:
        QATOptions.from_dict(value)
    assert needle in str(err.value), str(err.value)


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_any_swap():
    model = _model()
    with pytest.raises(ConfigError, match=r"groups of 48 along the input features do not divide .*q_proj \(64\)"):
        prepare_qat(model, {"weight_dtype": "int4", "group_size": 48})
    assert not any(hasattr(m, "weight_fake_quantizer") for m in model.modules())


def test_tensor_parallelism_is_refused_and_data_parallel_layouts_pass():
    model = _model()
    prepare_qat(model, EXAMPLES[0])
    with pytest.raises(ConfigError, match="tp_size=2: a row-wise TP shard sees a slice of each token's features"):
        check_qat_layout(model, ParallelismConfig(tp_size=2))
    for layout in ({"dp_shard_size": 2}, {"pp_size": 2}, {"cp_size": 2}):
        check_qat_layout(model, ParallelismConfig(**layout))
    with pytest.raises(ConfigError, match="call it once"):
        prepare_qat(model, EXAMPLES[0])


def test_train_config_stage(tmp_path):
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.extras import check_layout

    base = "base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: completion\n"
    path = tmp_path / "c.yml"
    path.write_text(base + "qat: {activation_dtype: int8, weight_dtype: int4, group_size: 256}\n")
    cfg = load_train_config(path, environ={})
    assert cfg.qat == {"activation_dtype": "int8", "weight_dtype": "int4", "group_size": 256}
    with pytest.raises(ConfigError, match="qat with tp_size=2"):
        check_layout(cfg, ParallelismConfig(tp_size=2), path)
    path.write_text(base + "qat: {weight_dtype: int4}\nload_in_4bit: true\nadapter: qlora\n")
    with pytest.raises(ConfigError, match="quantized by bitsandbytes already"):
        load_train_config(path, environ={})


def test_stacked_moe_experts_stay_unquantized_with_one_warning(caplog):
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=32))
    with caplog.at_level("WARNING", logger="nd_parallel.models.qat"):
        swapped = prepare_qat(model, {"weight_dtype": "int4"})
    assert not any(".experts" in name for name in swapped) and "lm_head" in swapped
    assert "4 stacked MoE expert tensors, e.g. model.layers.0.mlp.experts.gate_up_proj" in caplog.text


def test_group_size_against_a_local_model_is_refused_before_any_rank_starts(tmp_path):
    """Axolotl's examples/qwen3/8b-qat-fsdp2.yml on a small model: group_size 256 did not divide its 64 features;
    every rank raised that after launch. build_job checks it on the meta device from the local config.json."""
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.job import check_local_model
    from nd_parallel.testing.models import tiny_config

    tiny_config("llama").save_pretrained(tmp_path / "m")
    base = f"base_model: {tmp_path / 'm'}\ndatasets:\n  - path: ./d.jsonl\n    type: completion\n"
    path = tmp_path / "c.yml"
    path.write_text(base + "qat: {activation_dtype: int8, weight_dtype: int4, group_size: 256}\n")
    with pytest.raises(ConfigError, match=r"c.yml: qat with base_model .*m: QAT int4 groups of 256 along the input "
                                          r"features do not divide .*q_proj \(64\)"):
        check_local_model(load_train_config(path, environ={}), ParallelismConfig(dp_shard_size=2).resolve(2), path)
    path.write_text(base + "qat: {activation_dtype: int8, weight_dtype: int4, group_size: 32}\n")
    check_local_model(load_train_config(path, environ={}), ParallelismConfig(dp_shard_size=2).resolve(2), path)
