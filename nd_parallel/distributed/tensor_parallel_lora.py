"""LoRA under tensor parallelism: how a PEFT adapter is split when TP shards the layer it wraps.

An adapter follows its base layer (``lora_tp_styles``): with a column-wise base, ``lora_A`` stays whole and
``lora_B`` is split by output features like the base; with a row-wise base, ``lora_A`` is split by input
features like the base and ``lora_B`` stays whole. In both cases the adapter's output has the base output's
layout, so ``base(x) + B(A(x)) * scaling`` adds matching local pieces, and torch's styles put in the
collectives the gradients need (the all-reduce of ``dL/d(Ax)`` over TP for a column-wise base).
"""

from __future__ import annotations

import torch.nn as nn

# HF TP style of a base layer -> (style of lora_A, style of lora_B); None keeps that factor whole (plain).
LORA_TP_STYLES = {
    "colwise": (None, "colwise"),
    "colwise_rep": (None, "colwise_rep"),
    "colwise_gather_output": (None, "colwise_gather_output"),
    "rowwise": ("rowwise", None),
    "rowwise_rep": ("rowwise_rep", None),
    "rowwise_split_input": ("rowwise_split_input", None),
}
TP_FREE_LAYOUTS = "DDP, FSDP, HSDP, PP and CP (tp_size=1)"


def tuner_layer(module: nn.Module):
    """The module as a PEFT tuner layer (LoRA, IA3, ...), or None."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    return module if isinstance(module, BaseTunerLayer) else None


def _method(layer) -> str:
    return type(layer).__module__.split(".")[-2].upper() if "tuners" in type(layer).__module__ else type(layer).__name__


def lora_tp_styles(name: str, module: nn.Module, style: str) -> dict[str, str | None]:
    """The plan entries that shard a PEFT-wrapped ``module`` (plan name ``name``) as its base layer ``style``.

    Returns {submodule name: style}; a None style means "keep whole" (the entry is only for the caller's log).
    Raises for adapters TP cannot split, naming the method and the layouts where it works.
    """
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer) or not isinstance(module.get_base_layer(), nn.Linear):
        kind = f"{_method(module)} ({type(module).__name__})"
        raise NotImplementedError(
            f"tp_plan shards '{name}', which PEFT method {kind} wraps: that adapter cannot be split by tensor "
            f"parallelism. It works under {TP_FREE_LAYOUTS}; under TP use LoRA on Linear layers, or keep the "
            f"module whole with ParallelismConfig(tp_plan={{'{name}': None}})")
    variants = [a for a, on in getattr(module, "use_dora", {}).items() if on] or list(
        getattr(module, "lora_variant", {}) or {})
    if variants:
        raise NotImplementedError(
            f"'{name}' carries a LoRA variant (DoRA or another lora_variant, adapter '{variants[0]}'), whose weight "
            f"norm needs the whole base weight: it cannot be split by tensor parallelism. It works under "
            f"{TP_FREE_LAYOUTS}; under TP use plain LoRA (use_dora=False)")
    if style not in LORA_TP_STYLES:
        raise NotImplementedError(
            f"'{name}' is sharded as '{style}' and wrapped by LoRA: no LoRA split follows that style (supported base "
            f"styles: {sorted(LORA_TP_STYLES)}). Drop it from LoraConfig.target_modules, or keep it whole with "
            f"ParallelismConfig(tp_plan={{'{name}': None}})")
    a_style, b_style = LORA_TP_STYLES[style]
    entries = {f"{name}.base_layer": style}
    for adapter in module.lora_A:
        entries[f"{name}.lora_A.{adapter}"] = a_style
        entries[f"{name}.lora_B.{adapter}"] = b_style
    return entries


def expand_plan(model: nn.Module, matched: dict[str, str]) -> dict[str, str]:
    """Concrete plan entries with every PEFT-wrapped module replaced by its base layer and adapter entries."""
    modules = dict(model.named_modules())
    out = {}
    for name, style in matched.items():
        if tuner_layer(modules[name]) is None:
            out[name] = style
            continue
        out.update({k: v for k, v in lora_tp_styles(name, modules[name], style).items() if v is not None})
    return out


class KeepRequiresGrad:
    """torch's TP styles re-create parameters as ``nn.Parameter(DTensor)``, which is trainable by default: a frozen
    base weight would get gradients and optimizer updates. Remember which were frozen and freeze them again."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.frozen = {n for n, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return self

    def __exit__(self, *exc):
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if name in self.frozen and p.requires_grad:
                p.requires_grad_(False)
