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

Checkpoints (``save_state`` / ``load_state``) hold the quantized bytes and their statistics under HF names and load
them back as saved (``expose_8bit_scales``, ``accept_4bit_state``; the experts' in ``quantized_experts.py``).

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


# A 4-bit weight's quantization state in its state dict (bitsandbytes' QuantState.as_dict): these describe the format
# (they fix the shapes and meaning of the bytes, so must equal the live module's); the rest is data, restored.
_4BIT_FORMAT = ("quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype")


def accept_4bit_state(model: nn.Module) -> int:
    """Let a 4-bit Linear load back the quantization state its own state dict writes; returns how many Linears.

    bitsandbytes' ``Linear4bit`` (0.50) writes ``<prefix>weight.absmax``, ``.quant_map``, ``.nested_absmax``,
    ``.nested_quant_map`` and a packed ``.quant_state.bitsandbytes__<type>`` beside the packed weight, but takes none
    of them back, so a strict ``load_state_dict`` (``accelerator.load_state``) refuses them as unexpected keys.
    A load pre-hook consumes them. The saved state round-trips rather than being checked against the state the base
    was quantized to at this load: the checkpoint's packed bytes are loaded too, and they only mean what they meant
    with their own statistics; and re-quantizing gives the same bytes only with the same bitsandbytes kernels (a run
    saved on CUDA and resumed on CPU, or after an upgrade, need not). So the resumed base is the saved base, byte
    for byte, as a float frozen base is. The format (type, block size, dtype, shape) cannot change under a loaded
    module: a different one is refused, naming the value and the fix."""
    count = 0
    for module in model.modules():
        weight = module._parameters.get("weight")  # its own (the bnb layer), not PEFT's wrapper's view of it
        if getattr(weight, "quant_state", None) is not None and getattr(weight, "bnb_quantized", False):
            if not module.__dict__.get("_nd_parallel_4bit_load", False):
                module._register_load_state_dict_pre_hook(_load_4bit_state, with_module=True)
                module._nd_parallel_4bit_load = True
            count += 1
    return count


def _load_4bit_state(module: nn.Module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    from bitsandbytes.utils import unpack_tensor_to_dict

    weight = module.weight
    if getattr(weight.quant_state, "packing_format_for_cpu", False):  # an eval forward on CPU repacked it: undo
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
    qs, head = weight.quant_state, prefix + "weight."
    saved = {k[len(head):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(head)}
    if not saved:
        return  # a state dict without the quantization state (e.g. one the caller filtered): bytes only, as before
    split = module.__dict__.get("_nd_parallel_tp_part")
    if split is not None:  # plain tensors, which a checkpoint keeps once: every rank would get one rank's part
        errors.append(f"{head[:-1]}: this 4-bit Linear is split by tensor parallelism (dim {split[0]}, part "
                      f"{split[1]} of {split[2]}); its packed bytes and statistics are this rank's part, which a "
                      "checkpoint does not keep per rank, so loading it would give every rank one rank's part. "
                      "Resume a QLoRA run with tp_size=1 (dp_shard_size, pp_size or cp_size hold the base whole), "
                      "or keep the quantized layers whole (ParallelismConfig(tp_plan={<layer>: None, ...}))")
        return
    packed = [k for k in saved if k.startswith("quant_state.bitsandbytes__")]
    stats = unpack_tensor_to_dict(saved.pop(packed[0])) if len(packed) == 1 else {}
    live, found = qs.as_dict(), []
    fix = ("load the base with the BitsAndBytesConfig (bnb_4bit_quant_type, bnb_4bit_use_double_quant) and dtype "
           "it was saved with, and the same model config")
    for key in _4BIT_FORMAT:
        want = list(live[key]) if key == "shape" else live.get(key)
        if stats.get(key) != want:
            found.append(f"{head}{key}: {stats.get(key)!r} in the checkpoint, {want!r} in this 4-bit base; {fix}")
    missing_keys = sorted(k for k, v in live.items() if isinstance(v, torch.Tensor) and k not in saved)
    if found or missing_keys or set(saved) - set(live):
        errors.extend(found or [f"{head}: the checkpoint's quantization state holds {sorted(saved)}, this 4-bit base "
                          f"{sorted(k for k, v in live.items() if isinstance(v, torch.Tensor))}; {fix}"])
        return
    with torch.no_grad():
        targets = {"absmax": qs.absmax, "quant_map": qs.code}
        if qs.nested:
            targets.update(nested_absmax=qs.state2.absmax, nested_quant_map=qs.state2.code)
            qs.offset.fill_(stats["nested_offset"])  # data (the mean of the block scales), stored as a Python float
        for key, target in targets.items():
            value = saved[key]
            if value.shape != target.shape or value.dtype != target.dtype:
                errors.append(f"{head}{key}: {value.dtype}{tuple(value.shape)} in the checkpoint, "
                              f"{target.dtype}{tuple(target.shape)} in this 4-bit base; {fix}")
            elif not torch.equal(value.to(target.device), target):  # DCP may already have loaded it in place
                target.copy_(value)


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
