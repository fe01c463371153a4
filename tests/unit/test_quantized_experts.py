"""Quantized MoE expert tensors (models/quantized_experts.py, Axolotl's quantize_moe_experts) in one process: what
is quantized, within NF4's / int8's own error of the float checkpoint, frozen, deterministic, the same bytes when
quantized as it loads or afterwards; a LoRA adapter trains on top; the layouts that would split them are refused."""

from __future__ import annotations

import contextlib

import pytest
import torch

from nd_parallel import ParallelismConfig
from nd_parallel.models.quantized import check_quantized, quantized_params
from nd_parallel.models.quantized_experts import quantize_experts, quantized_experts, quantizing_experts

pytest.importorskip("bitsandbytes")

# A tiny qwen3_moe: 4 experts, the stacked tensors gate_up_proj [4, 128, 64] and down_proj [4, 64, 64] per layer.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
NAMES = [f"model.layers.{i}.mlp.experts.{n}" for i in range(2) for n in ("gate_up_proj", "down_proj")]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from nd_parallel.testing.models import save_tiny_model

    return str(save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), **MOE))


def _load(model_dir, bits=None, experts=False):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = {}
    if bits:
        q = {"device_map": "cpu", "quantization_config": BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else
             BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)}
    with quantizing_experts(bits) if experts else contextlib.nullcontext():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **q)


def _tensor(model, name):
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr)


def test_nf4_experts_within_nf4_error_frozen_and_the_same_bytes_as_loaded_or_after(moe_dir):
    """Each element within its 64-value block's NF4 rounding: half the widest gap between NF4 levels times the block's
    absmax, plus the double-quantized absmax's own error (|level| <= 1). Frozen uint8 data, half a byte per value;
    the loader hook and quantize_experts on the loaded model give the same bytes."""
    import bitsandbytes.functional as bnbf

    from nd_parallel.distributed.tensor_parallel_quantized import _absmax_fp32

    floats, model = _load(moe_dir), _load(moe_dir, 4, experts=True)
    assert sorted(quantized_experts(model)) == sorted(NAMES)
    levels = bnbf.get_4bit_type("nf4", device="cpu").sort().values
    half_gap = float((levels[1:] - levels[:-1]).max()) / 2  # 0.139 (between 0.723 and 1.0)
    for name in NAMES:
        original, got = _tensor(floats, name).detach(), _tensor(model, name)
        assert got.shape == original.shape and got.dtype == torch.float32
        chain = model.get_submodule(name.rpartition(".")[0]).parametrizations[name.rpartition(".")[2]]
        data, qs = chain.original, chain[0].quant_state
        assert data.dtype == torch.uint8 and not data.requires_grad and data.numel() == original.numel() // 2
        absmax = original.reshape(-1, 64).abs().amax(1)
        bound = half_gap * absmax + (_absmax_fp32(qs) - absmax).abs()
        err = (got - original).reshape(-1, 64).abs()
        assert (err <= bound[:, None] * (1 + 1e-6)).all(), (name, float((err - bound[:, None]).max()))
        assert err.max() > 0  # quantized, not the float tensor
    after = _load(moe_dir, 4)
    assert quantize_experts(after, 4) == 4
    mine, theirs = dict(model.named_parameters()), dict(after.named_parameters())  # packed bytes by name
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert len(quantized_params(model)) == 8 + 4  # the 4-bit attention Linears (the router is no Linear), experts


def test_int8_experts_within_a_row_step(moe_dir):
    """8-bit (load_in_8bit): int8 rows with one scale per row; each element within half a step (absmax / 254) of
    its row's fp16 value, and the fp16 rounding (2^-11 relative) before it."""
    floats, model = _load(moe_dir), _load(moe_dir, 8, experts=True)
    assert sorted(quantized_experts(model)) == sorted(NAMES)
    for name in NAMES:
        original, got = _tensor(floats, name).detach(), _tensor(model, name)
        rows = original.reshape(-1, original.shape[-1])
        bound = rows.abs().amax(1, keepdim=True) / 254 * (1 + 1e-3) + rows.abs() * 2 ** -11
        assert ((got.reshape(rows.shape) - rows).abs() <= bound).all(), name


def test_a_lora_adapter_trains_on_a_quantized_experts_base(moe_dir):
    """Forward and backward through the dequantized experts; the adapter trains, the packed experts do not move."""
    from peft import LoraConfig, get_peft_model

    model = _load(moe_dir, 4, experts=True)
    packed = [p.clone() for p in quantized_params(model)]
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(1, 256, (4, 24))
    losses = []
    for _ in range(5):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(a, b) for a, b in zip(packed, quantized_params(model)))
    check_quantized(model.get_base_model(), ParallelismConfig(dp_shard_size=2), has_adapter=True)
    check_quantized(model.get_base_model(), ParallelismConfig(pp_size=2), has_adapter=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_lora_on_the_quantized_expert_tensors_equals_lora_on_their_float_values(moe_dir, bits):
    """LoRA on the quantized expert tensors themselves (peft's target_parameters, Axolotl's lora_target_parameters)
    is LoRA on a float model holding the same dequantized experts, bit for bit: the same adapter keys (peft nests one
    ParamWrapper per tensor in the module's definition order), the same seeded init, every adapter gets a gradient
    (the inner one too: models/peft.py's caching fix), and 4 AdamW steps give the same losses and adapter. Short
    suffixes match the parametrized experts, as they match plain tensors."""
    from peft import LoraConfig, get_peft_model

    quantized = _load(moe_dir, bits, experts=True)
    plain = _load(moe_dir, bits)  # the same quantized Linears; float experts set to the dequantized values
    for name in NAMES:
        _tensor(plain, name).data.copy_(_tensor(quantized, name))
    runs = {}
    for key, model in (("quantized", quantized), ("float", plain)):
        torch.manual_seed(0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                            target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        model = get_peft_model(model, config).train()
        adapter = [p for n, p in model.named_parameters() if p.requires_grad]
        init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        opt = torch.optim.AdamW(adapter, lr=1e-2)
        torch.manual_seed(1)
        batch, losses, graded = torch.randint(1, 256, (4, 24)), [], set()
        for _ in range(4):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            graded |= {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[key] = (init, losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                     graded)
    (init_q, losses_q, end_q, graded_q), (init_f, losses_f, end_f, graded_f) = runs["quantized"], runs["float"]
    experts = sorted(n for n in end_q if ".experts." in n)
    assert len(experts) == 8 and sorted(end_q) == sorted(end_f), experts  # A and B, 2 tensors, 2 layers
    assert all(torch.equal(init_q[n], init_f[n]) for n in init_q)
    assert graded_q == graded_f and set(experts) <= graded_q, sorted(set(experts) - graded_q)
    assert losses_q == losses_f and losses_q[-1] < losses_q[0], (losses_q, losses_f)
    assert all(torch.equal(end_q[n], end_f[n]) for n in end_q)


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(dp_shard_size=2, ep_size=2)])
def test_tp_and_ep_are_refused_with_the_fix(moe_dir, layout):
    model = _load(moe_dir, 4, experts=True)
    with pytest.raises(ValueError, match=r"_size=2: .* 4 quantized MoE expert tensors .*use dp_shard_size"):
        check_quantized(model, ParallelismConfig(**layout), has_adapter=True)


def test_the_yaml_key_follows_axolotls_rules_and_refuses_what_is_not_implemented(tmp_path):
    """Config stage: Axolotl's rules (an adapter, load_in_4bit/8bit, not lora_target_linear) in one message; LoRA on
    the quantized expert tensors (lora_target_parameters) accepted; TP/EP refused before any rank starts."""
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.extras import check_layout
    from nd_parallel.config import ConfigError

    head = "base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: chat_template\nquantize_moe_experts: true\n"
    path = tmp_path / "c.yml"
    path.write_text(head + "lora_target_linear: true\nlora_target_parameters: [mlp.experts.gate_up_proj]\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(path, environ={})
    for part in ("without an adapter", "without load_in_4bit or load_in_8bit", "with lora_target_linear"):
        assert part in str(err.value), part
    assert "quantized expert tensors" not in str(err.value)
    path.write_text(head + "adapter: qlora\nload_in_4bit: true\nlora_target_modules: [q_proj]\n")
    cfg = load_train_config(path, environ={})
    assert cfg.quantize_moe_experts
    check_layout(cfg, ParallelismConfig(dp_shard_size=2), path)
    check_layout(cfg, ParallelismConfig(pp_size=2), path)
    with pytest.raises(ConfigError, match=r"quantize_moe_experts with tp_size=2: .* use dp_shard_size"):
        check_layout(cfg, ParallelismConfig(tp_size=2), path)
    path.write_text(head + "adapter: qlora\nload_in_4bit: true\nlora_target_modules: [q_proj]\n"
                    "lora_target_parameters: [mlp.experts.gate_up_proj]\n")
    cfg = load_train_config(path, environ={})  # LoRA on the quantized experts themselves: FSDP2 / DDP / CP
    check_layout(cfg, ParallelismConfig(dp_shard_size=2), path)
    with pytest.raises(ConfigError, match=r"lora_target_parameters with pp_size=2: .* use dp_shard_size"):
        check_layout(cfg, ParallelismConfig(pp_size=2), path)


def test_state_dict_names_resolve_by_getattr_and_load_back(moe_dir):
    """torch's distributed state dict (accelerator.get_state_dict / save_state) resolves every key by getattr along
    its dotted name: the packed experts are saved under torch's parametrization name with their statistics (buffers
    of the parametrization: absmax, quant_map, offset, nested_absmax, nested_quant_map), and load back into them (the
4-bit Linears' own loading is bitsandbytes', not checked here)."""
    model = _load(moe_dir, 4, experts=True)
    state = model.state_dict()
    assert "model.layers.0.mlp.experts.parametrizations.gate_up_proj.original" in state
    for key in state:
        obj = model
        for part in key.split("."):
            obj = getattr(obj, part)
    experts = {k: torch.zeros_like(v) for k, v in state.items() if ".parametrizations." in k}
    assert len(experts) == 4 * 6 and not model.load_state_dict(experts, strict=False).unexpected_keys
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in experts.items())  # loaded into the packed data


def test_torch_distributed_state_dict_round_trips_the_quantized_experts(moe_dir, one_rank_group):
    """get_/set_model_state_dict (what save_state / load_state use) on a model whose only quantized tensors are
    its experts (from_pretrained without BitsAndBytesConfig, under quantizing_experts): every key resolves and
    loads back, strict; the statistics too: overwritten, they are the saved ones again, and so is the dequantized
    tensor (a checkpoint restores bytes and statistics together, issue 19)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoModelForCausalLM

    with quantizing_experts(4):
        model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    assert sorted(quantized_experts(model)) == sorted(NAMES) and len(quantized_params(model)) == 4
    saved = {k: v.clone() for k, v in get_model_state_dict(model).items()}
    key = "model.layers.0.mlp.experts.parametrizations.gate_up_proj.original"
    experts = model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.clone()
    with torch.no_grad():
        dict(model.named_parameters())[key].zero_()
        experts.parametrizations.gate_up_proj[0].nested_absmax.mul_(2)
        experts.parametrizations.gate_up_proj[0].offset.add_(1)
    assert not torch.equal(experts.gate_up_proj, before)
    set_model_state_dict(model, saved)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    assert torch.equal(experts.gate_up_proj, before)
