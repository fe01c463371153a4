"""PEFT adapters (LoRA) under every layout: what the rest of nd_parallel needs to know about a ``PeftModel``.

A ``PeftModel`` is a thin wrapper: ``PeftModel -> LoraModel -> the HF causal LM``, where each targeted
``nn.Linear`` inside the HF model was replaced by a ``lora.Linear`` holding the original as ``.base_layer`` and
the adapter as ``lora_A[name]`` / ``lora_B[name]``. nd_parallel parallelizes the *inner* HF model (its plans,
pipeline split and checkpoint names are the HF model's own; only ``.base_layer`` / ``.lora_*`` segments are
added) and hands back the wrapper, so ``model(**batch)`` still runs PEFT's forward. Under PP the prepared model
is the pipeline, which remembers the wrapper (``PeftInfo``) for saving the adapter.

How an adapter is split under TP is TP's concern (``nd_parallel.distributed.tensor_parallel_lora``); building
a LoRA model on the meta device is loading's (``meta.build_meta_peft_model``). This module imports neither.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the HF model's own names
INFO_ATTR = "_nd_parallel_peft"


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


def linear_target_names(model: nn.Module, extra=None) -> list[str]:
    """Axolotl's ``lora_target_linear`` (``find_all_linear_names``): the leaf names of the model's Linear layers
    but the output head's, plus ``extra`` (``lora_target_modules``). Not peft's ``'all-linear'``: on transformers 5
    peft rewrites that, for Mixtral and Qwen3-MoE, to what it meant on their v4 classes, adding the router and the
    fused expert tensors, which Axolotl's list does not reach (and peft's ParamWrapper refuses lora_dropout)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # GPT-2's Conv1D too, as peft's all-linear has it (Axolotl's list misses it unquantized, and then adapts nothing)
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and m is not head and
             (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" or "Linear" in type(m).__name__)}
    head_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and m is head}
    extra = [] if extra is None else [extra] if isinstance(extra, str) else list(extra)
    return sorted((names - head_names) | set(extra))


@contextmanager
def expert_lora_without_dropout():
    """Axolotl's ``_patch_peft_param_wrapper_dropout`` for the length of ``get_peft_model``: LoRA on a fused expert
    tensor (peft's ParamWrapper; peft adds these itself for v4 expert names such as Mixtral's ``w1``/``w2``) is
    built with dropout 0, since it cannot factor dropout out of an expert-indexed matmul, while the other LoRA
    layers keep ``lora_dropout``. Yields the list of parameter names it built that way (for a note)."""
    from peft.tuners.lora.layer import ParamWrapper

    built: list[str] = []
    original = ParamWrapper.__init__

    def init(self, base_layer, adapter_name, parameter_name, config, *args, **kwargs):
        if getattr(config, "lora_dropout", 0):
            config = copy.copy(config)
            config.lora_dropout = 0.0
            built.append(parameter_name)
        original(self, base_layer, adapter_name, parameter_name, config, *args, **kwargs)

    ParamWrapper.__init__ = init
    try:
        yield built
    finally:
        ParamWrapper.__init__ = original


def lora_on_parametrized_experts() -> None:
    """LoRA on quantized MoE expert tensors (Axolotl's ``quantize_moe_experts`` with ``lora_target_parameters``):
    three fixes to peft, installed once for the process by ``models/quantized_experts.py``. The first acts only on the
    expert modules it quantized (they carry ``_nd_parallel_param_order``); the other two change nothing for a tensor
    with no other parametrization (peft's own path).

    - Matching and order. On a module whose tensor is already parametrized, peft (0.20, 0.21) matches
      ``target_parameters`` by the full dotted name only and wraps the matches in sorted-name order, where on a plain
      module it matches by suffix and wraps in the module's definition order. The order decides which ``ParamWrapper``
      is nested inside which (the adapter's key names) and the order of the adapters' seeded init draws. Here, a
      quantized expert module is matched by suffix and wrapped in its definition order (recorded before quantizing),
      so the adapter has the keys and the initial values it has on the unquantized model under the same seed, and
      loads or merges there (Axolotl patches the same two points, ``monkeypatch/moe_quant.py``).
    - Removal. After each forward peft removes its LoRA proxy from the parametrization chain; with another
      parametrization underneath (the dequantization) it looks for ``_LoraParameterProxy`` only, but peft 0.21
      registers ``_LoraFactorsProxy`` for a single adapter on an expert stack: the proxy stayed registered and the next
      forward failed. Either proxy is removed here (peft 0.20 has only the first).
    - Caching. peft 0.21's ``_activate_lora`` reads its tensor (``get_param``) before registering its proxy; an
      outer wrapper of the same module already holds torch's parametrization cache open, so that read of a
      parametrized tensor (the dequantization) was cached without the inner adapter's delta and the forward used
      it: the inner adapter (``gate_up_proj`` or ``down_proj``, by nesting) got no gradient (measured; peft 0.20,
      Axolotl's pin, gives both a gradient; plain tensors are not cached). That entry is dropped once the proxy is
      registered."""
    from peft.tuners.lora import layer as lora_layer
    from peft.tuners.tuners_utils import BaseTuner

    if getattr(BaseTuner._inject_parameters, "_nd_parallel", False):
        return
    proxies = tuple(c for c in (getattr(lora_layer, "_LoraParameterProxy", None),
                                getattr(lora_layer, "_LoraFactorsProxy", None)) if c is not None)
    remove, inject = lora_layer.ParamWrapper._remove_parametrizations, BaseTuner._inject_parameters
    activate = lora_layer.ParamWrapper._activate_lora

    @contextmanager
    def activate_uncached(self, active_adapters):
        import torch.nn.utils.parametrize as P

        with activate(self, active_adapters):
            P._cache.pop((id(self.get_base_layer()), self.parameter_name), None)  # torch's cache key
            yield

    def remove_proxy(self):
        chain = self.get_base_layer().parametrizations[self.parameter_name]
        if len(chain) > 1 and isinstance(chain[-1], proxies):  # peft's proxy is always the last one registered
            del chain[-1]
            return
        remove(self)

    def inject_parameters(self, peft_config, model, adapter_name, low_cpu_mem_usage):
        ours = _wrap_parametrized_experts(self, peft_config, model, adapter_name, low_cpu_mem_usage)
        theirs = inject(self, peft_config, model, adapter_name, low_cpu_mem_usage)
        if theirs is None:  # peft 0.20 records the names on the tuner and returns nothing
            self.targeted_parameter_names.extend(ours)
            return None
        return ours + [k for k in theirs if k not in ours]

    inject_parameters._nd_parallel = True
    lora_layer.ParamWrapper._remove_parametrizations = remove_proxy
    lora_layer.ParamWrapper._activate_lora = activate_uncached
    BaseTuner._inject_parameters = inject_parameters


def _wrap_parametrized_experts(tuner, peft_config, model, adapter_name, low_cpu_mem_usage) -> list[str]:
    """peft's own steps for one targeted tensor (``_get_submodules``, its compatibility check,
    ``_create_and_replace`` with ``parameter_name``), for the quantized expert modules, by suffix, in definition
    order. A second tensor of the same module wraps the first one's ``ParamWrapper``, as peft nests them."""
    from contextlib import nullcontext

    from peft.utils.integrations import init_empty_weights
    from peft.utils.other import _get_submodules

    targets = list(getattr(peft_config, "target_parameters", None) or [])
    done: list[str] = []
    for module_name, module in list(model.named_modules()):
        order = getattr(module, "_nd_parallel_param_order", None)
        if not targets or order is None or not hasattr(module, "parametrizations"):
            continue
        for name in (n for n in order if n in module.parametrizations):
            key = f"{module_name}.{name}"
            if not any(key == t or key.endswith(f".{t}") for t in targets):
                continue
            parent, target, target_name = _get_submodules(model, module_name)
            tuner._check_target_module_compatiblity(peft_config, model, target_name)
            with init_empty_weights() if low_cpu_mem_usage else nullcontext():
                tuner._create_and_replace(peft_config, adapter_name, target, target_name, parent, current_key=key,
                                          parameter_name=name)
            done.append(key)
    return done
