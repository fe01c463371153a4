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
