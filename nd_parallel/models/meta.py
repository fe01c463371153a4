"""The model built without weights: a causal LM on the meta device, matched to its checkpoint's keys.

``build_meta_model`` builds a causal LM from its config on the meta device (accelerate's
``init_empty_weights(include_buffers=False)``): parameters have shapes and dtypes but no storage, while buffers
are still computed on the CPU by the model's own ``__init__``, so non-persistent buffers (rotary ``inv_freq``,
embedding scales) get the values a normal build gives. Only the safetensors *headers* are read: every
parameter is matched to its checkpoint key (through transformers' own key renamings) and its shape checked,
so a wrong checkpoint fails before any process group exists. ``build_meta_peft_model`` does the same under a
LoRA adapter. The model carries a ``LazyCheckpoint``; ``loading.load_local_shards`` reads it at prepare.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from .checkpoint_files import PlainLoadNeeded, Tensors, read_headers, resolve_dtype
from .peft import check_targets

logger = logging.getLogger(__name__)

ATTR = "_nd_parallel_checkpoint"  # where a meta-built model keeps the description of its checkpoint
_META_INITS = (True, False, "gaussian")  # LoRA inits that need no base weight (PiSSA, OLoRA, LoftQ, EVA do)


@dataclass
class LazyCheckpoint:
    """Attached to a meta-built model: where each of its tensors lives in the checkpoint."""

    directory: str
    tensors: Tensors
    names: dict[str, str]  # model state-dict name (every alias of a tied weight) -> checkpoint key
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys the model has no place for
    # Tensors that are not in the checkpoint but known in full on every rank (a fresh PEFT adapter's init):
    # model name -> full tensor; each rank copies its own box of it, like a checkpoint read.
    initial: dict[str, torch.Tensor] = field(default_factory=dict)

    def initial_tensors(self) -> list[torch.Tensor]:
        return [self.initial[k] for k in sorted(self.initial)]


def lazy_checkpoint(model: nn.Module) -> LazyCheckpoint | None:
    """The checkpoint a meta-built model still has to read, or None for a model with real weights."""
    return getattr(model, ATTR, None)


def _split_kwargs(path, hf_kwargs: dict):
    """(config, dtype argument, model kwargs, key mapping), or PlainLoadNeeded for keywords only the plain path
    knows (device_map, quantization_config, tp_plan, variant, ...); config attributes are overrides, as in
    from_pretrained."""
    from transformers import AutoConfig

    kwargs = dict(hf_kwargs)
    dtype = kwargs.pop("dtype", None)
    dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
    model_kwargs = {k: kwargs.pop(k) for k in ("attn_implementation", "trust_remote_code") if k in kwargs}
    key_mapping = kwargs.pop("key_mapping", None)
    config = kwargs.pop("config", None)
    if config is None:
        trust = model_kwargs.get("trust_remote_code", False)  # never True unless the user asked for it
        config, kwargs = AutoConfig.from_pretrained(path, return_unused_kwargs=True, trust_remote_code=trust,
                                                    **kwargs)
    if kwargs:
        raise PlainLoadNeeded(f"from_pretrained arguments {sorted(kwargs)}")
    quantized = getattr(config, "quantization_config", None)  # AutoConfig takes a passed one as an attribute too
    if quantized is not None:  # its quantizer converts tensors on load (gpt-oss' MXFP4 blocks -> experts, bnb, ...)
        method = (quantized.get("quant_method") if isinstance(quantized, dict)
                  else getattr(quantized, "quant_method", ""))
        raise PlainLoadNeeded(f"a quantization_config ({getattr(method, 'value', method)}): transformers' quantizer "
                              "converts those tensors on load")
    return config, dtype, model_kwargs, key_mapping


def _weight_transforms(model: nn.Module, key_mapping):
    """transformers' renamings and converters for this model (4.x has none: identity)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # older transformers: checkpoint keys are module names
        return [], [], []
    try:
        mapping = get_model_conversion_mapping(model, key_mapping)
    except TypeError as err:  # another transformers 5.x signature: its own loader knows it
        raise PlainLoadNeeded(f"transformers' conversion mapping API is not the one known here ({err})") from err
    return (mapping, [m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def _rename(key: str, renamings, converters, prefix: str, expected: dict) -> tuple[str, bool]:
    """The model name a checkpoint key loads into, and whether a converter (not a plain rename) is needed."""
    try:
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        rename_source_key = None
    if rename_source_key is not None:
        try:
            renamed, converter = rename_source_key(key, renamings, converters, prefix, expected)
        except TypeError as err:
            raise PlainLoadNeeded(f"transformers' key renaming API is not the one known here ({err})") from err
        if renamed not in expected and key in expected:
            renamed, converter = key, None  # transformers keeps a key that already names a parameter
        return renamed, converter is not None
    # Without conversion mappings only the base-model prefix may differ (a base-model checkpoint).
    if key not in expected and prefix and f"{prefix}.{key}" in expected:
        return f"{prefix}.{key}", False
    if key not in expected and prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in expected:
        return key[len(prefix) + 1:], False
    return key, False


def match_checkpoint(model: nn.Module, tensors: Tensors, key_mapping=None) -> LazyCheckpoint:
    """Map every parameter and persistent buffer of ``model`` to its checkpoint key, checking shapes.

    Raises ``PlainLoadNeeded`` where transformers would convert tensors on load, and ``ValueError`` for a
    checkpoint that does not fit the model (missing parameters, wrong shapes), naming the first offender.
    """
    expected = model.state_dict()  # meta tensors: names and shapes only; tied weights appear under every name
    mapping, renamings, converters = _weight_transforms(model, key_mapping)
    prefix = getattr(model, "base_model_prefix", "") or ""
    names, unexpected, converted = {}, [], []
    for key in sorted(tensors.files):
        target, needs_converter = _rename(key, renamings, converters, prefix, expected)
        if target not in expected:
            unexpected.append(key)
        elif needs_converter:
            converted.append(key)
        else:
            names[target] = key
    if converted:
        raise PlainLoadNeeded(f"{len(converted)} checkpoint tensors (first: '{converted[0]}') are converted by "
                              "transformers on load (merged/split), which is not read slice by slice")
    model._weight_conversions = [m for m in mapping if m.was_used()]  # as transformers keeps them for saving
    _fill_tied_names(model, names)
    missing = [n for n, t in expected.items() if n not in names and not _is_buffer_kept(model, n)]
    if missing:
        raise ValueError(
            f"{len(missing)} parameters of {type(model).__name__} are not in the checkpoint (first: '{missing[0]}'); "
            "a plain from_pretrained would initialise them randomly, which the memory-efficient path does not do. "
            "Use a checkpoint that holds them, or plugin.from_pretrained(path, memory_efficient=False)"
        )
    wrong = [(n, tuple(t.shape), tensors.shapes[names[n]]) for n, t in expected.items()
             if n in names and tuple(t.shape) != tensors.shapes[names[n]]]
    if wrong:
        name, want, got = wrong[0]
        raise ValueError(f"{len(wrong)} checkpoint tensors do not fit {type(model).__name__} (first: '{name}' has "
                         f"shape {got} in the checkpoint, the model expects {want}); is it a checkpoint of another "
                         "model or config?")
    return LazyCheckpoint("", tensors, names, unexpected)


def _fill_tied_names(model: nn.Module, names: dict[str, str]) -> None:
    """Every alias of a shared parameter reads the key of its first alias found (the embedding for a tied head,
    as transformers ties the head to the embedding)."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for group in aliases.values():
        source = next((names[n] for n in group if n in names), None)
        if source is not None:
            for n in group:
                names[n] = source


def _is_buffer_kept(model: nn.Module, name: str) -> bool:
    """A persistent buffer the checkpoint lacks keeps the value the model's __init__ computed."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return leaf in module._buffers


def build_meta_model(path: str | Path, **hf_kwargs) -> nn.Module:
    """A causal LM with meta parameters, real buffers, and a ``LazyCheckpoint`` describing where its weights are.

    Raises ``PlainLoadNeeded`` where only transformers' own loader gives the right model.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    directory = Path(path)
    if not directory.is_dir():
        raise PlainLoadNeeded(f"'{path}' is not a local directory (download it first, e.g. `hf download`)")
    tensors = read_headers(directory)
    config, dtype, model_kwargs, key_mapping = _split_kwargs(str(directory), hf_kwargs)
    dtype = resolve_dtype(dtype, config, tensors)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    # init_empty_weights re-creates every parameter it registers, which undoes the tie made inside __init__.
    model.tie_weights()
    if getattr(model, "_get_dtype_plan", None) and model._get_dtype_plan(dtype):
        raise PlainLoadNeeded(f"{type(model).__name__} keeps some modules in fp32 when loaded as {dtype}")
    lazy = match_checkpoint(model, tensors, key_mapping)
    lazy.directory = str(directory)
    # from_pretrained makes every parameter it reads trainable if it is floating point, whatever the module asked
    # at __init__ (Marian's sinusoidal positions are built frozen, and trained after a load): as it does.
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in lazy.names:
            param.requires_grad_(param.is_floating_point())
    # Stale buffers old checkpoints carry, and the model's own ignore list, are dropped silently as transformers does.
    ignore = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []), r"rotary_emb\.inv_freq",
              r"(^|\.)position_ids$"]
    unexpected = [k for k in lazy.unexpected if not any(re.search(p, k) for p in ignore)]
    if unexpected:
        logger.warning("%d checkpoint tensors have no place in %s and are not read (first: '%s')",
                       len(unexpected), type(model).__name__, unexpected[0])
    model.config.name_or_path = str(path)
    if (directory / "generation_config.json").is_file() and getattr(model, "generation_config", None) is not None:
        model.generation_config = GenerationConfig.from_pretrained(directory)
    model.eval()  # as from_pretrained returns it
    setattr(model, ATTR, lazy)
    return model


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
