"""PEFT adapters (LoRA) under every layout: what the rest of nd_parallel needs to know about a ``PeftModel``.

A ``PeftModel`` is a thin wrapper: ``PeftModel -> LoraModel -> the HF causal LM``, where each targeted
``nn.Linear`` inside the HF model was replaced by a ``lora.Linear`` holding the original as ``.base_layer`` and
the adapter as ``lora_A[name]`` / ``lora_B[name]``. nd_parallel parallelizes the *inner* HF model (its plans,
pipeline split and checkpoint names are the HF model's own; only ``.base_layer`` / ``.lora_*`` segments are
added) and hands back the wrapper, so ``model(**batch)`` still runs PEFT's forward. Under PP the prepared model
is the pipeline, which remembers the wrapper (``PeftInfo``) for saving the adapter.

Under TP an adapter follows its base layer (``lora_tp_styles``): with a column-wise base, ``lora_A`` stays
whole and ``lora_B`` is split by output features like the base; with a row-wise base, ``lora_A`` is split by
input features like the base and ``lora_B`` stays whole. In both cases the adapter's output has the base
output's layout, so ``base(x) + B(A(x)) * scaling`` adds matching local pieces, and torch's styles put in the
collectives the gradients need (the all-reduce of ``dL/d(Ax)`` over TP for a column-wise base).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

logger = logging.getLogger("nd_parallel")

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the HF model's own names
INFO_ATTR = "_nd_parallel_peft"

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


@dataclass
class PeftInfo:
    """Kept on a prepared pipeline (not an nn.Module attribute, so it is no submodule): the original wrapper."""

    wrapper: nn.Module


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is a requirement, but a model can only be a PeftModel if it is importable
        return False
    return isinstance(model, PeftModel)


def peft_wrapper(model) -> nn.Module | None:
    """The ``PeftModel`` a prepared (or unprepared) model stands for, or None for a plain model."""
    if is_peft_model(model):
        return model
    info = model.__dict__.get(INFO_ATTR) if isinstance(model, nn.Module) else None
    return info.wrapper if info is not None else None


def base_of(model: nn.Module) -> nn.Module:
    """The HF model inside a PeftModel (with its LoRA layers); any other model unchanged."""
    return model.get_base_model() if is_peft_model(model) else model


def check_peft_model(model: nn.Module) -> None:
    """Refuse PEFT methods whose parameters live outside the HF model (no layout could shard them)."""
    if not is_peft_model(model):
        return
    for name, config in model.peft_config.items():
        if getattr(config, "is_prompt_learning", False):
            raise NotImplementedError(
                f"PEFT adapter '{name}' is {config.peft_type.value} (prompt learning): its virtual-token encoder "
                "runs outside the HF model, which nd_parallel splits; use a LoRA adapter (peft.LoraConfig)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameter (requires_grad=False everywhere); "
                         "wrap it with get_peft_model(model, LoraConfig(...)) in training mode")


def unwrap(model: nn.Module) -> tuple[nn.Module | None, nn.Module]:
    """(PeftModel or None, the HF model to parallelize)."""
    return (model, base_of(model)) if is_peft_model(model) else (None, model)


def rewrap(wrapper: nn.Module | None, prepared: nn.Module, inner: nn.Module) -> nn.Module:
    """What prepare returns: the wrapper when the inner model was parallelized in place, else the pipeline
    (which remembers the wrapper for saving the adapter)."""
    if wrapper is None:
        return prepared
    if prepared is inner:
        return wrapper
    object.__setattr__(prepared, INFO_ATTR, PeftInfo(wrapper))
    return prepared


def with_peft_names(model: nn.Module, state: dict) -> dict:
    """HF names -> PeftModel names (``base_model.model.`` + name), as ``PeftModel.state_dict()`` has them."""
    if peft_wrapper(model) is None or not state or next(iter(state)).startswith(PEFT_PREFIX):
        return state
    return {PEFT_PREFIX + k: v for k, v in state.items()}


# ------------------------------------------------------------------------------------------------ TP
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


# ------------------------------------------------------------------------------------------- init sync
def broadcast_trainable(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Give every rank rank 0's adapter init (a few MiB): ranks seeded differently would otherwise start from
    different adapters, which FSDP would silently mix and a TP-replicated lora_A would make inconsistent."""
    import torch.distributed as dist

    if not tensors or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in tensors:
            buf = t.detach().to(device)
            dist.broadcast(buf, src=0)
            if buf is not t:
                t.copy_(buf)


# ----------------------------------------------------------------------------------------- targets
def check_targets(model: nn.Module, peft_config) -> None:
    """LoRA target modules that match no module are refused with the names that exist (before any collective)."""
    targets = getattr(peft_config, "target_modules", None)
    if targets is None or targets == "all-linear" or getattr(peft_config, "is_prompt_learning", False):
        return  # None: PEFT picks its default for the architecture; 'all-linear' matches every Linear
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [n for n, _ in model.named_modules() if n]
    if any(check_target_module_exists(peft_config, n) for n in names):
        return
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    raise ValueError(f"{type(peft_config).__name__}.target_modules={targets!r} matches no module of "
                     f"{type(model).__name__}; its Linear layers are named {leaves}: pick target_modules from these "
                     "(e.g. ['q_proj', 'v_proj']) or 'all-linear'")


# ------------------------------------------------------------------------------- memory-efficient load
_META_INITS = (True, False, "gaussian")  # LoRA inits that need no base weight (PiSSA, OLoRA, LoftQ, EVA do)


def build_meta_peft_model(path, peft_config, **hf_kwargs) -> nn.Module:
    """``get_peft_model`` over a meta-built model: base weights are read slice by slice at prepare, as for
    ``build_meta_model``; the adapter is initialised here in full (it is small) and each rank copies its box.

    PEFT's ``low_cpu_mem_usage=True`` creates the adapter on meta; each LoRA layer then gets PEFT's own
    ``reset_lora_parameters`` (``init_lora_weights``) on the CPU, in module order, so the init depends only
    on the torch seed. It follows the same distribution as a plain ``get_peft_model`` but not the same draws
    (that one also draws ``nn.Linear``'s default init first); prepare then gives every rank rank 0's values.
    """
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    from .loading import PlainLoadNeeded, build_meta_model, lazy_checkpoint

    init = getattr(peft_config, "init_lora_weights", True)
    if type(peft_config).__name__ != "LoraConfig" or init not in _META_INITS:
        raise PlainLoadNeeded(f"{type(peft_config).__name__}(init_lora_weights={init!r}) initialises the adapter "
                              "from the base weights or is not LoRA")
    with torch.random.fork_rng(devices=[]):  # building on meta draws init values a plain load does not
        model = build_meta_model(path, **hf_kwargs)
    check_targets(model, peft_config)
    lazy = lazy_checkpoint(model)
    wrapper = get_peft_model(model, peft_config, low_cpu_mem_usage=True)
    inner = wrapper.get_base_model()
    # Base weights moved under `.base_layer`: the same checkpoint keys, under their new names.
    renamed = {name: lazy.names.get(name.replace(".base_layer", "")) for name in inner.state_dict()}
    lazy.names = {name: key for name, key in renamed.items() if key is not None}
    for mod_name, module in inner.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in list(module.lora_A):
            parts = [module.lora_A[adapter], module.lora_B[adapter]]
            for part in parts:
                part.to_empty(device="cpu")
            if init is False:  # PEFT then keeps nn.Linear's own init
                for part in parts:
                    part.reset_parameters()
            else:
                module.reset_lora_parameters(adapter, init)
            for prefix, part in ((f"{mod_name}.lora_A.{adapter}", parts[0]), (f"{mod_name}.lora_B.{adapter}",
                                                                            parts[1])):
                for leaf, p in list(part.named_parameters()):
                    lazy.initial[f"{prefix}.{leaf}"] = p.detach().clone()
                    part._parameters[leaf] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    missing = [n for n, p in inner.named_parameters() if n not in lazy.names and n not in lazy.initial]
    if missing:
        raise PlainLoadNeeded(f"{len(missing)} adapter parameters (first: '{missing[0]}') are neither in the "
                              "checkpoint nor a LoRA factor initialised here")
    return wrapper
