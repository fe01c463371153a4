"""The QLoRA / 8-bit LoRA parity recipe shared by the rank program (qlora_worker.py) and the one-process reference.

The base is quantized by transformers' bitsandbytes integration as it loads the checkpoint (NF4 with double
quantization, or LLM.int8()). Quantization is a deterministic function of the weights (measured: the same packed
bytes and statistics on every load), so every rank and the reference hold the same quantized base, and the
adapter (seeded init, no dropout) is what trains.
"""

from __future__ import annotations

import torch
from peft_recipe import SEED, lora_config


def quantization(bits: int):
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


def qlora_model(model_dir, bits: int = 4, experts: bool = False):
    """``experts``: the MoE's fused expert tensors quantized too, as they load (quantize_moe_experts)."""
    import contextlib

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from nd_parallel.models.quantized_experts import quantizing_experts

    with quantizing_experts(bits) if experts else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization(bits),
                                                     device_map="cpu", dtype=torch.float32)
    torch.manual_seed(SEED)
    # Training mode, as the Trainer sets it: from_pretrained returns eval mode, in which bitsandbytes (0.50, CPUs with
    # AVX512-BF16) repacks a 4-bit weight and multiplies in bf16 whenever the input needs no gradient (the first
    # layer's projections under LoRA), a path the fp32 reference of a split layer cannot follow.
    return get_peft_model(model, lora_config()).train()


def assert_adapter_matches(ref, got) -> None:
    """A layout's run (``got``, a rank's saved result) equals the one-process reference on the same quantized base:
    loss, grad norm and adapter within 1e-5 (both hold the same dequantized base; only the fp32 reduction order of
    the adapter's gradients differs), every rank alike, and the adapter trains."""
    from nd_parallel.testing.parity import RunResult, compare

    adapter = {k: v for k, v in ref.state.items() if "lora_" in k}
    assert adapter and set(got["state"]) == set(adapter)
    diff = compare(RunResult(ref.losses, ref.norms, adapter), RunResult(got["losses"], got["norms"], got["state"]))
    assert diff["loss_rel"] <= 1e-5 and diff["norm_rel"] <= 1e-5 and diff["param_abs"] <= 1e-5, diff
    assert got["rank_spread"] == 0.0
    assert ref.losses[-1] < ref.losses[0]  # the adapter trains


def assert_resume_equals(whole, resumed, save_at: int, steps: int) -> None:
    """A run saved after step ``save_at`` and resumed under the same layout equals the uninterrupted one bit for bit:
    every later loss and grad norm, the final adapter, and the quantized base's digest (packed bytes and statistics)."""
    assert len(resumed["losses"]) == steps - save_at
    assert resumed["losses"] == whole["losses"][save_at:], (resumed["losses"], whole["losses"])
    assert resumed["norms"] == whole["norms"][save_at:], (resumed["norms"], whole["norms"])
    assert set(resumed["state"]) == set(whole["state"]) and resumed["state"]
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    assert resumed["base_digest"] == whole["base_digest"] is not None
