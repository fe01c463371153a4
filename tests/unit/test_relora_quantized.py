"""ReLoRA on a quantized base (plugins/trainer/relora_quantized.py) and on bitsandbytes' optimizer states
(relora.prune_moments): a restart quantizes float weight + delta again (not the dequantized codes + delta), keeps the
sum in fp16 for the next restart, and a run ends with the merged float model; 8-bit moments are pruned by value, a
pruned one decoding to exactly 0. The config stage takes Axolotl's relora.yml settings and refuses TP / EP."""

import json

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import load_file

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.restarts import check_layout
from nd_parallel.config import ConfigError, ParallelismConfig
from nd_parallel.plugins.trainer.relora import _values, merge_and_reinit, merged_floats, prune_moments
from nd_parallel.plugins.trainer.relora_quantized import FloatMaster, save_merged


def _nf4(value: torch.Tensor, like) -> torch.Tensor:
    """What NF4 quantization of ``value`` with ``like``'s settings decodes to."""
    q = bnb.nn.Params4bit(value.float().contiguous(), requires_grad=False, blocksize=like.blocksize,
                          compress_statistics=like.compress_statistics, quant_type=like.quant_type).to("cpu")
    return bnb.functional.dequantize_4bit(q.data, q.quant_state)


def _decoded(weight) -> torch.Tensor:
    return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)


@pytest.fixture
def qlora(tiny_models):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    source = tiny_models["llama"]
    base = AutoModelForCausalLM.from_pretrained(source, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    return model, source


def _randomize_b(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_a_restart_quantizes_the_float_weight_plus_the_delta_again(qlora, tmp_path):
    model, source = qlora
    checkpoint = load_file(f"{source}/model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    master = FloatMaster(source, str(tmp_path))
    expected = checkpoint[key].float()
    for step in (2, 4):  # the first restart reads the checkpoint, the second the first one's fp16 copy
        _randomize_b(model, step)
        delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
        expected = expected + delta.detach()
        merge_and_reinit(model, 0, step, master=master)
        assert torch.equal(_decoded(layer.get_base_layer().weight), _nf4(expected, layer.get_base_layer().weight))
        kept = load_file(str(tmp_path / "relora_base" / f"step-{step}" / "rank-0.safetensors"))
        assert torch.equal(kept[key], expected.half()) and set(kept) == {
            f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")}
        expected = kept[key].float()  # Axolotl keeps the float weights in fp16
        assert not layer.lora_B["default"].weight.any()  # a new adapter: B = 0


def test_the_run_ends_with_the_merged_float_model(qlora, tmp_path):
    model, source = qlora
    master = FloatMaster(source, str(tmp_path))
    _randomize_b(model, 1)
    merge_and_reinit(model, 0, 2, master=master)
    _randomize_b(model, 2)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    key = "model.layers.1.mlp.down_proj.weight"
    want = load_file(str(tmp_path / "relora_base" / "step-2" / "rank-0.safetensors"))[key].float() + delta.detach()
    merged_floats(model, master, 5)
    out = tmp_path / "out"
    out.mkdir()
    save_merged(master, 5, model.config, str(out))
    saved, base = load_file(str(out / "model.safetensors")), load_file(f"{source}/model.safetensors")
    assert set(saved) == set(base) and torch.equal(saved[key], want.half())
    assert torch.equal(saved["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_8bit_moments_are_pruned_by_value():
    """Axolotl zeroes the uint8 codes: code 0 of the signed map decodes to -0.993 x absmax. Here a pruned moment
    takes the code of 0 and the magnitude threshold is the quantile of the decoded values."""
    torch.manual_seed(0)
    lora = torch.nn.Parameter(torch.randn(64, 128))  # >= 4096 values: 8-bit state
    model = torch.nn.Module()
    model.lora_A = lora
    opt = bnb.optim.AdamW8bit([lora], lr=1e-3)
    for _ in range(2):
        lora.grad = torch.randn(64, 128)
        opt.step()
    state = opt.state[lora]
    assert state["state1"].dtype == torch.uint8 and _values(state, "state1").min() < 0
    assert round(float(state["qmap1"][0]), 3) == -0.993  # what a zeroed code would decode to
    before = {k: _values(state, k).clone() for k in ("state1", "state2")}
    codes = {k: state[k].clone() for k in ("state1", "state2")}
    zeros, total = prune_moments(model, opt, 0, 1, "magnitude", 0.75)
    assert total == 2 * 64 * 128 and abs(zeros / total - 0.75) < 0.01
    for key in ("state1", "state2"):
        after, was = _values(state, key), before[key]
        pruned = state[key] != codes[key]
        assert (after[pruned] == 0).all() and torch.equal(after[~pruned], was[~pruned])
        threshold = torch.quantile(was.abs().flatten(), 0.75)
        assert (was[pruned].abs() <= threshold).all() and (was[~pruned].abs() > threshold).all()
    prune_moments(model, opt, 0, 2, "random", 1.0)
    assert all((_values(state, k) == 0).all() for k in ("state1", "state2"))


def test_axolotls_relora_yaml_settings_pass_and_tp_is_refused(tmp_path):
    (tmp_path / "c.yml").write_text(
        "base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: alpaca\nadapter: qlora\nload_in_4bit: true\n"
        "relora: true\nrelora_prune_ratio: 0.9\nrelora_cpu_offload: false\njagged_restart_steps: 150\n"
        "jagged_restart_warmup_steps: 10\njagged_restart_anneal_steps: false\noptimizer: adamw_bnb_8bit\n")
    cfg = load_train_config(tmp_path / "c.yml", environ={})
    check_layout(cfg, ParallelismConfig(dp_shard_size=2), "c.yml")
    check_layout(cfg, ParallelismConfig(pp_size=2), "c.yml")
    with pytest.raises(ConfigError, match="relora on a quantized base with tensor / expert parallelism"):
        check_layout(cfg, ParallelismConfig(tp_size=2), "c.yml")


def test_a_restart_on_an_8bit_base_keeps_the_function(tmp_path):
    """LoRA on LLM.int8 (load_in_8bit): after the restart the model computes what it computed before, up to int8's
    rounding of float + delta (a row's absmax / 127 per weight, ~6e-4 here: logits move by 2.3e-3), and still
    trains."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from nd_parallel.testing.models import save_tiny_model

    source = str(save_tiny_model("llama", tmp_path / "m", seed=1))
    base = AutoModelForCausalLM.from_pretrained(source, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    _randomize_b(model, 3)
    ids = torch.arange(10)[None]
    before = model(input_ids=ids).logits.detach()
    merge_and_reinit(model, 0, 2, master=FloatMaster(source, str(tmp_path / "out")))
    weight = model.base_model.model.model.layers[0].self_attn.q_proj.get_base_layer().weight
    assert weight.dtype == torch.int8
    assert (model(input_ids=ids).logits.detach() - before).abs().max() < 1e-2
    model(input_ids=ids, labels=ids).loss.backward()
