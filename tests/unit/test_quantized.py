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
    (dict(tp_size=2), r"tp_size=2: .* packed 4-bit/8-bit weight .* Use dp_shard_size"),
    (dict(pp_size=2, pp_backend="deepspeed"), r"pp_backend='deepspeed': .* use pp_backend='torch'"),
])
def test_layouts_a_quantized_base_does_not_compose_with_are_refused(nf4, layout, match):
    check_quantized(nf4, ParallelismConfig(dp_shard_size=2), has_adapter=True)  # FSDP2: fine
    with pytest.raises(ValueError, match=match):
        check_quantized(nf4, ParallelismConfig(**layout), has_adapter=True)


def test_an_8bit_base_is_refused_with_the_4bit_alternative(tiny_models):
    with pytest.raises(ValueError, match=r"8-bit \(LLM.int8, load_in_8bit\).* use a 4-bit base \(QLoRA"):
        check_quantized(_load(tiny_models["llama"], 8), ParallelismConfig(), has_adapter=True)


def test_8bit_optimizer_trains_plain_parameters_and_is_refused_on_shards(one_rank_group):
    import bitsandbytes as bnb
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from nd_parallel.accelerate.checks import check_optimizer_on_shards

    plain = torch.nn.Parameter(torch.randn(8192))
    opt = bnb.optim.AdamW8bit([plain], lr=1e-3)
    check_optimizer_on_shards(opt)
    before = plain.detach().clone()
    plain.grad = torch.randn_like(plain)
    opt.step()
    assert opt.state[plain]["state1"].dtype == torch.uint8 and not torch.equal(before, plain)  # 8-bit state, stepped
    shard = torch.nn.Parameter(distribute_tensor(torch.randn(8192), init_device_mesh("cpu", (1,)), [Shard(0)]))
    for cls in (bnb.optim.AdamW8bit, bnb.optim.PagedAdamW8bit):
        with pytest.raises(ValueError, match=r"cannot step sharded \(DTensor\) parameters.*adamw_torch"):
            check_optimizer_on_shards(cls([shard], lr=1e-3))
    check_optimizer_on_shards(torch.optim.AdamW([shard]))  # torch's own steps DTensors
