"""Quantized bases (models/quantized.py): deterministic NF4 quantization, and the layouts refused up front."""

from __future__ import annotations

import pytest
import torch

from nd_parallel import ParallelismConfig
from nd_parallel.models.quantized import check_quantized, quantized_params

pytest.importorskip("bitsandbytes")


def _load(model_dir, bits=4):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = (BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else
         BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.float32))
    return AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=q, device_map="cpu")


@pytest.fixture(scope="module")
def nf4(tiny_models):
    return _load(tiny_models["llama"])


def test_nf4_quantization_is_deterministic_and_half_a_byte_per_weight(tiny_models, nf4):
    again = _load(tiny_models["llama"])
    a, b = quantized_params(nf4), quantized_params(again)
    assert len(a) == 14  # 7 projections x 2 layers
    for p, q in zip(a, b):
        assert torch.equal(p, q) and torch.equal(p.quant_state.absmax, q.quant_state.absmax)
    linear = sum(m.in_features * m.out_features for m in nf4.modules() if type(m).__name__ == "Linear4bit")
    assert sum(p.numel() * p.element_size() for p in a) == linear // 2  # two NF4 values per byte


def test_a_quantized_base_without_an_adapter_is_refused(nf4):
    with pytest.raises(ValueError, match=r"quantized .* but no adapter: .*adapter: qlora with load_in_4bit"):
        check_quantized(nf4, ParallelismConfig(), has_adapter=False)


@pytest.mark.parametrize("layout,match", [
    (dict(pp_size=2, pp_backend="deepspeed"), r"pp_backend='deepspeed': .* use pp_backend='torch'"),
])
def test_layouts_a_quantized_base_does_not_compose_with_are_refused(nf4, layout, match):
    check_quantized(nf4, ParallelismConfig(dp_shard_size=2), has_adapter=True)  # FSDP2: fine
    check_quantized(nf4, ParallelismConfig(tp_size=2), has_adapter=True)  # TP: tensor_parallel_quantized.py
    with pytest.raises(ValueError, match=match):
        check_quantized(nf4, ParallelismConfig(**layout), has_adapter=True)


def test_an_8bit_base_trains_under_fsdp2_and_pp_and_is_refused_under_tp_with_the_fix(tiny_models):
    """LoRA on LLM.int8 (load_in_8bit): FSDP2 / PP / one process accepted (parity rows: test_qlora.py); TP has no
    style for int8 rows and their scales, refused before any collective naming tp_size and the alternatives."""

    int8 = _load(tiny_models["llama"], 8)
    for layout in ({}, dict(dp_shard_size=2), dict(pp_size=2), dict(cp_size=2)):
        check_quantized(int8, ParallelismConfig(**layout), has_adapter=True)
    with pytest.raises(ValueError, match=r"tp_size=2: .*8-bit \(LLM.int8, load_in_8bit\).* use tp_size=1 .*load_in_4bit"):
        check_quantized(int8, ParallelismConfig(tp_size=2), has_adapter=True)


def test_an_8bit_base_state_dict_names_resolve_and_load_after_a_forward(tiny_models):
    """expose_8bit_scales: torch's distributed state dict resolves every key by getattr (SCB / weight_format must
    resolve), and after a training forward (which moves weight.SCB into state.SCB) the base still loads its
    checkpoint, as accelerator.load_state does."""
    from peft import LoraConfig, get_peft_model

    from nd_parallel.models.quantized import expose_8bit_scales

    model = get_peft_model(_load(tiny_models["llama"], 8), LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    assert expose_8bit_scales(model) == 14  # the bnb layers themselves, not PEFT's wrappers around two of them
    keys = [k for k in model.state_dict() if k.endswith((".SCB", ".weight_format"))]
    assert len(keys) == 28
    for key in keys:
        module, attr = key.rsplit(".", 1)
        getattr(model.get_submodule(module), attr)
    model.train()(torch.randint(0, 32, (1, 8)))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(saved)  # without the pre-hook: "Loading a quantized checkpoint into non-quantized ..."
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())


def test_a_4bit_base_loads_back_its_own_quantization_state_strictly(tiny_models):
    """accept_4bit_state (issue 19): a 4-bit Linear's state dict holds weight.absmax, .quant_map, .nested_absmax,
    .nested_quant_map and a packed .quant_state.bitsandbytes__nf4, which bitsandbytes does not take back (a strict
    load, as accelerator.load_state does, refused them as unexpected keys). They now load, and round-trip: statistics
    that differ from the saved ones (here overwritten) are the saved ones again after the load, byte for byte; a
    checkpoint of another format (block size) is refused with the value and the fix."""
    from bitsandbytes.utils import pack_dict_to_tensor, unpack_tensor_to_dict
    from peft import LoraConfig, get_peft_model

    from nd_parallel.models.quantized import accept_4bit_state

    model = get_peft_model(_load(tiny_models["llama"]), LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    assert accept_4bit_state(model) == 14 and accept_4bit_state(model) == 14  # the bnb layers, hooked once
    model.train()(torch.randint(0, 32, (1, 8)))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    blob = next(k for k in saved if k.endswith("q_proj.base_layer.weight.quant_state.bitsandbytes__nf4"))
    qs = model.get_submodule(blob[:-len(".weight.quant_state.bitsandbytes__nf4")]).weight.quant_state
    qs.absmax.add_(1)
    qs.offset.add_(1.0)
    qs.state2.absmax.mul_(2)
    model.load_state_dict(saved)  # strict
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    stats = unpack_tensor_to_dict(saved[blob])
    saved[blob] = pack_dict_to_tensor({**stats, "blocksize": 128})
    with pytest.raises(RuntimeError, match=r"weight.blocksize: 128 in the checkpoint, 64 in this 4-bit base; load "
                                           r"the base with the BitsAndBytesConfig"):
        model.load_state_dict(saved)
    saved[blob] = pack_dict_to_tensor(stats)
    model.get_submodule(blob[:-len(".weight.quant_state.bitsandbytes__nf4")])._nd_parallel_tp_part = (0, 1, 2)
    with pytest.raises(RuntimeError, match=r"split by tensor parallelism .*part 1 of 2.* Resume a QLoRA run with "
                                           r"tp_size=1"):  # a TP-split layer's state is one rank's: refused
        model.load_state_dict(saved)


def _bnb_run(make_params, steps=3):
    """AdamW8bit over the parameters ``make_params`` builds, fed the same gradients: (parameter, state) each step."""
    import bitsandbytes as bnb

    from nd_parallel.distributed.optimizer_8bit import step_local_shards

    torch.manual_seed(0)
    full, grads = torch.randn(64, 128), [torch.randn(64, 128) for _ in range(steps)]
    param, grad_of, value_of = make_params(full)
    opt = bnb.optim.AdamW8bit([param], lr=1e-2)
    step_local_shards(opt)
    for g in grads:
        param.grad = grad_of(g)
        opt.step()
        opt.zero_grad()
    stepped = opt.param_groups[0]["params"][0]
    return value_of(param).detach().clone(), opt.state[stepped]


def test_8bit_optimizer_steps_a_local_shard_bit_equal_to_one_process(one_rank_group):
    """A rank's dim-0 shard whose ends fall on bitsandbytes' 256-value blocks is stepped exactly as those rows are in
    one process: same 8-bit codes, same block absmax, same parameters (optimizer_8bit.py derives why)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from nd_parallel.distributed.optimizer_8bit import shard_alignment

    mesh = init_device_mesh("cpu", (1,))
    plain_param, plain_state = _bnb_run(lambda full: (torch.nn.Parameter(full.clone()), lambda t: t, lambda t: t))
    assert plain_state["state1"].dtype == torch.uint8  # 8192 values >= min_8bit_size: 8-bit state

    def rows(lo, hi):  # this "rank" holds rows [lo, hi) of a [64, 128] parameter, as FSDP2's Shard(0) does
        def shard(t):
            return DTensor.from_local(t[lo:hi].clone(), mesh, [Shard(0)], run_check=False, shape=t.shape,
                                      stride=t.stride())

        return lambda full: (torch.nn.Parameter(shard(full)), shard, lambda p: p.to_local())

    for lo, hi in ((0, 32), (32, 64)):  # 32 rows x 128 = 4096 values: 16 whole blocks, under min_8bit_size alone
        param, state = _bnb_run(rows(lo, hi))
        assert state["state1"].dtype == torch.uint8  # 8-bit as for the whole tensor, though the shard is 4096 values
        assert torch.equal(param, plain_param[lo:hi]), (lo, hi)
        assert torch.equal(state["state1"], plain_state["state1"][lo:hi])
        assert torch.equal(state["absmax1"], plain_state["absmax1"][lo * 128 // 256:hi * 128 // 256])
    d = DTensor.from_local(torch.zeros(3, 128), mesh, [Shard(0)], run_check=False, shape=(64, 128), stride=(128, 1))
    assert shard_alignment(DTensor.from_local(torch.zeros(32, 128), mesh, [Shard(0)], run_check=False,
                                              shape=(64, 128), stride=(128, 1)))
    assert not shard_alignment(d)  # 384 values: its blocks are not one process's blocks


def test_checkpointing_an_8bit_optimizer_on_shards_is_refused_with_the_fix(one_rank_group):
    """Its state is keyed to per-rank plain parameters that torch's distributed state dict cannot map back: refused
    before any collective (the check reads only the optimizer), naming the optimizer and the fix."""
    import bitsandbytes as bnb
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from nd_parallel.distributed.optimizer_8bit import refuse_checkpoint, step_local_shards

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(DTensor.from_local(torch.zeros(64, 128), mesh, [Shard(0)], run_check=False))
    opt = bnb.optim.AdamW8bit([param], lr=1e-2)
    refuse_checkpoint([opt], "save_state")  # nothing stepped on shards yet: allowed
    step_local_shards(opt)
    with pytest.raises(NotImplementedError, match=r"save_state: AdamW8bit .*\(optim: adamw_torch\)"):
        refuse_checkpoint([opt], "save_state")
    refuse_checkpoint([torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])], "load_state")
