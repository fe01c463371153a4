"""Quantized base weights (QLoRA's 4-bit NF4, LoRA on 8-bit): which parameters they are and what layouts hold them.

A model loaded with transformers' ``BitsAndBytesConfig`` (``load_in_4bit`` / ``load_in_8bit``) holds its Linear
weights as bitsandbytes ``Params4bit`` (packed uint8, two NF4 values per byte, per-64-value absmax statistics,
themselves 8-bit quantized with double quantization) or ``Int8Params`` (int8 with per-row scales). They are frozen:
only an adapter trains. What each layout does with them:

- one process, PP (torch backend): each stage holds its layers' quantized weights as loaded;
- FSDP2 / HSDP, and CP (whose ranks FSDP shards over): the quantized weights are left out of sharding
  (``fully_shard(ignored_params=...)``) and stay replicated, 0.5 byte per parameter (NF4) on every rank; the adapter,
  norms and embeddings are sharded as usual. A packed weight's blocks and their statistics are not a tensor FSDP2
  can cut along dim 0 and all-gather back (its statistics live beside it, in ``quant_state``);
- 8-bit bases: refused (their scales are extra state that torch's distributed state dict cannot address);
- TP (4-bit): each quantized Linear the plan splits gets our own style (``distributed/tensor_parallel_quantized.py``):
  sharded (this rank's packed bytes and block statistics) where the blocks line up with the split, replicated
  otherwise; quantized layers the plan does not name stay whole and replicated.

Identified from the parameters, not from class names: a frozen parameter that is not floating point is a
quantized weight (nothing else can be: autograd only trains floating tensors).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def quantized_params(model: nn.Module) -> list[nn.Parameter]:
    """The frozen integer-typed (quantized) parameters of ``model``, each once."""
    seen, out = set(), []
    for p in model.parameters():
        if not p.is_floating_point() and not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def check_quantized(model: nn.Module, config, has_adapter: bool) -> None:
    """Refuse, before any collective, the layouts a quantized base does not compose with."""
    found = quantized_params(model)
    if not found:
        return
    what = f"{type(model).__name__} holds {len(found)} quantized (4-bit/8-bit) weights"
    if not has_adapter:
        raise ValueError(f"{what} but no adapter: quantized weights cannot be trained; wrap the model with "
                         "get_peft_model(model, LoraConfig(...)) (YAML: adapter: qlora with load_in_4bit, or "
                         "adapter: lora with load_in_8bit), or load it unquantized for full fine-tuning")
    int8 = [p for p in found if p.dtype == torch.int8]
    if int8:
        raise ValueError(f"{what}, {len(int8)} of them 8-bit (LLM.int8, load_in_8bit): bitsandbytes keeps their "
                         "scales as extra state (SCB) that torch's distributed state dict cannot address, so the "
                         "model could train but not be saved; use a 4-bit base (QLoRA: load_in_4bit with "
                         "adapter: qlora) or LoRA on the unquantized model")
    if config.pp_size > 1 and config.pp_backend == "deepspeed":
        raise ValueError(f"pp_backend='deepspeed': {what}; DeepSpeed's pipeline engine casts and partitions the "
                         "weights itself; use pp_backend='torch'")
