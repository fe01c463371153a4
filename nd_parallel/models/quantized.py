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
- 8-bit bases (LLM.int8: int8 rows, one fp32 scale per row, ``SCB``) the same way under FSDP2/HSDP, CP and PP (torch
  backend): replicated under FSDP2 and CP, per stage under PP. Refused under TP, which has no style for them yet;
- quantized MoE expert tensors (``quantized_experts.py``: Axolotl's ``quantize_moe_experts``) likewise: replicated
  under FSDP2 / HSDP and CP, per stage under PP; refused under TP and EP, which split the expert tensors (their
  styles act on float ``[E, ...]`` parameters, not on packed blocks under a parametrization);
- TP (4-bit): each quantized Linear the plan splits gets our own style (``distributed/tensor_parallel_quantized.py``):
  sharded (this rank's packed bytes and block statistics) where the blocks line up with the split, replicated
  otherwise; quantized layers the plan does not name stay whole and replicated.

Identified from the parameters, not from class names: a frozen parameter that is not floating point is a
quantized weight (nothing else can be: autograd only trains floating tensors).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .quantized_experts import quantized_experts


def quantized_params(model: nn.Module) -> list[nn.Parameter]:
    """The frozen integer-typed (quantized) parameters of ``model``, each once."""
    seen, out = set(), []
    for p in model.parameters():
        if not p.is_floating_point() and not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def expose_8bit_scales(model: nn.Module) -> int:
    """Let torch's distributed state dict save and load an 8-bit Linear's scales; returns how many Linears.

    Two gaps in bitsandbytes' ``Linear8bitLt`` (0.50), each closed here for the modules of ``model``:
    - it writes ``<prefix>SCB`` and ``<prefix>weight_format`` into its state dict from ``weight.SCB`` / ``state.SCB``
      but has no attributes of those names, and ``get_model_state_dict`` resolves every key by ``getattr`` along its
      dotted name (``_get_fqns``). Plain attributes of those names let the names resolve; the values still come from
      the module's own ``_save_to_state_dict``.
    - its first forward moves ``weight.SCB`` into ``state.SCB`` (``init_8bit_state``), after which its
      ``_load_from_state_dict`` refuses the checkpoint's ``SCB`` ("non-quantized Linear8bitLt"). A load pre-hook
      points ``weight.SCB`` back at that same tensor, so the load copies into it (``accelerator.load_state``)."""
    count = 0
    for module in model.modules():
        weight = module._parameters.get("weight")  # its own, not a wrapper's view of it (PEFT's LoRA layer)
        scb = getattr(weight, "SCB", None)
        scb = scb if scb is not None else getattr(getattr(module, "state", None), "SCB", None)
        if weight is not None and weight.dtype == torch.int8 and scb is not None:
            if "SCB" not in module.__dict__:
                object.__setattr__(module, "SCB", scb)
                object.__setattr__(module, "weight_format", "row")
                module._register_load_state_dict_pre_hook(_scales_back_on_weight, with_module=True)
            count += 1
    return count


def _scales_back_on_weight(module: nn.Module, *args, **kwargs) -> None:
    if getattr(module.weight, "SCB", None) is None and getattr(module.state, "SCB", None) is not None:
        module.weight.SCB = module.state.SCB


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
    if int8 and config.tp_size > 1:
        raise ValueError(f"tp_size={config.tp_size}: {what}, {len(int8)} of them 8-bit (LLM.int8, load_in_8bit), whose "
                         "int8 rows and per-row scales (SCB) have no tensor-parallel style; use tp_size=1 with "
                         "dp_shard_size or pp_size for an 8-bit base, or a 4-bit base (load_in_4bit with adapter: "
                         "qlora), which TP splits")
    experts = quantized_experts(model)
    split = {k: v for k, v in (("tp_size", config.tp_size), ("ep_size", getattr(config, "ep_size", 1))) if v > 1}
    if experts and split:
        sizes = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ValueError(f"{sizes}: {type(model).__name__} holds {len(experts)} quantized MoE expert tensors (e.g. "
                         f"{experts[0]!r}, quantize_moe_experts), which tensor and expert parallelism would split, "
                         "and they have no split for packed bitsandbytes blocks; use dp_shard_size (FSDP2, the "
                         "experts replicated), cp_size or pp_size, or load the experts unquantized")
    if config.pp_size > 1 and config.pp_backend == "deepspeed":
        raise ValueError(f"pp_backend='deepspeed': {what}; DeepSpeed's pipeline engine casts and partitions the "
                         "weights itself; use pp_backend='torch'")
