"""Quantized MoE expert tensors (Axolotl's ``quantize_moe_experts``): a MoE's fused 3-D expert weights as a frozen
bitsandbytes 4-bit (NF4 / FP4) or 8-bit base.

transformers' ``BitsAndBytesConfig`` quantizes ``nn.Linear`` layers only; a transformers 5 experts module keeps its
experts stacked in parameters (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) that it leaves in
float, most of a MoE's weights. Axolotl (``monkeypatch/moe_quant.py``) replaces each such >= 3-D parameter, as it
loads, by quantized data under a torch parametrization that dequantizes on access, and so do we:

- 4-bit: bitsandbytes' ``replace_parameter_4bit`` (``quantize_4bit`` of the whole tensor: 64-value blocks,
  ``bnb_4bit_quant_type`` and ``bnb_4bit_use_double_quant`` as for the Linears; its ``Bnb4bitParametrization``),
  the packed bytes a frozen ``uint8`` parameter, dequantized to the original dtype on access (cached for one
  forward of the module);
- 8-bit: int8 rows with one scale per row (``int8_vectorwise_quant`` of the fp16 tensor, Axolotl's recipe),
  dequantized on access to the original dtype.

The experts are found from the model (``moe.expert_modules``: its ep plan, else its structure), not by name. The
packed data is a frozen integer parameter, so ``quantized.quantized_params`` finds it like a 4-bit Linear's, and
every rule there applies (no training without an adapter; left out of FSDP2's sharding, replicated).

Where Axolotl acts only on CUDA tensors (on a CPU load its patch leaves the experts in float, silently), we quantize
on any device: bitsandbytes 0.50's CPU backend quantizes and dequantizes the same formats.

The packed data's name is torch's parametrization path (``mlp.experts.parametrizations.gate_up_proj.original``), in
``named_parameters`` and in the state dict alike (see ``quantize_tensor``); the same in every layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as P

from .moe import expert_modules


class Int8RowsParametrization(nn.Module):
    """Dequantizes int8 rows (one fp32 scale per row of the last dim) to ``dtype`` on access."""

    def __init__(self, row_stats: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("row_stats", row_stats)
        self.dtype = dtype

    @torch.no_grad()
    def forward(self, data: torch.Tensor) -> torch.Tensor:
        import bitsandbytes.functional as bnbf

        rows = bnbf.int8_vectorwise_dequant(data.reshape(-1, data.shape[-1]), self.row_stats)
        return rows.reshape(data.shape).to(self.dtype)


def _dequantize_4bit(state) -> nn.Module:
    """bitsandbytes' ``Bnb4bitParametrization`` whose block statistics are buffers, saved and loaded with the packed
    data (as ``Int8RowsParametrization``'s row scales are): a resumed run's experts are the saved ones, bytes and
    statistics together, even where quantizing the checkpoint again would not give the same bytes (another kernel
    or bitsandbytes version). The buffers are the truth (torch moves them and loads into them in place); the quant
    state is pointed at them before every dequantization."""
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    class Dequantize4bit(Bnb4bitParametrization):
        def __init__(self, state):
            super().__init__(state)
            self.register_buffer("absmax", state.absmax)
            self.register_buffer("quant_map", state.code)
            if state.nested:
                self.register_buffer("offset", state.offset)
                self.register_buffer("nested_absmax", state.state2.absmax)
                self.register_buffer("nested_quant_map", state.state2.code.clone())  # bitsandbytes shares that map

        def forward(self, data: torch.Tensor) -> torch.Tensor:
            qs = self.quant_state
            qs.absmax, qs.code = self.absmax, self.quant_map
            if qs.nested:
                qs.offset, qs.state2.absmax, qs.state2.code = self.offset, self.nested_absmax, self.nested_quant_map
            return super().forward(data)

    return Dequantize4bit(state)


def _cache_on(module, inputs):  # dequantize each expert tensor once per forward of its module
    P._cache_enabled += 1


def _cache_off(module, inputs, output):
    P._cache_enabled = max(0, P._cache_enabled - 1)  # also runs after a forward that raised (always_call)
    if not P._cache_enabled:
        P._cache = {}


def quantize_tensor(module: nn.Module, name: str, bits: int, quant_type: str = "nf4",
                    double_quant: bool = True) -> None:
    """Replace ``module.<name>`` by its ``bits``-bit quantized data under a dequantizing parametrization (frozen).

    4-bit is bitsandbytes' ``replace_parameter_4bit`` (the same call, the same bytes) without its state-dict hook,
    which renames the data to ``<name>`` and adds ``<name>.absmax`` etc.: torch's distributed state dict resolves
    every key by ``getattr`` along its dotted name, and ``module.<name>`` is the dequantized tensor, which has no
    ``absmax``. The data stays under torch's own name (``parametrizations.<name>.original``), which resolves; the
    quantization statistics are buffers of the parametrization (``parametrizations.<name>.0.absmax`` etc.; 8-bit:
    ``.row_stats``), saved and loaded with the data, so a checkpoint restores both together."""
    import bitsandbytes.functional as bnbf

    if not hasattr(module, "_nd_parallel_param_order"):  # for LoRA on these tensors (models/peft.py)
        from .peft import lora_on_parametrized_experts

        lora_on_parametrized_experts()  # once per process: peft's fixes for adapters on parametrized experts
        module._nd_parallel_param_order = list(module._parameters)
    weight = getattr(module, name)
    if bits == 4:
        data, state = bnbf.quantize_4bit(weight.data, compress_statistics=double_quant, quant_type=quant_type)
        parametrization = _dequantize_4bit(state)
    else:
        data, row_stats, _ = bnbf.int8_vectorwise_quant(weight.data.reshape(-1, weight.shape[-1]).to(torch.float16))
        data, parametrization = data.reshape(weight.shape), Int8RowsParametrization(row_stats, weight.dtype)
    setattr(module, name, nn.Parameter(data, requires_grad=False))
    del weight
    P.register_parametrization(module, name, parametrization, unsafe=True)
    if not getattr(module, "_nd_parallel_dequantize_cache", False):
        module.register_forward_pre_hook(_cache_on)
        module.register_forward_hook(_cache_off, always_call=True)
        module._nd_parallel_dequantize_cache = True


def expert_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``"<module>.<param>"`` -> (experts module, parameter name) for every >= 3-D stacked expert parameter."""
    return {f"{e.name}.{n}": (e.module, n) for e in expert_modules(model) for n in e.stacked
            if getattr(e.module, n).dim() >= 3}


def quantize_experts(model: nn.Module, bits: int, quant_type: str = "nf4", double_quant: bool = True) -> int:
    """Quantize the expert tensors of a loaded model in place, one at a time; returns how many. Peak memory is the
    float model: to quantize each tensor as it is read, load under ``quantizing_experts`` instead."""
    found = expert_tensors(model)
    for module, name in found.values():
        quantize_tensor(module, name, bits, quant_type, double_quant)
    return len(found)


@contextlib.contextmanager
def quantizing_experts(bits: int, quant_type: str = "nf4", double_quant: bool = True, done: list | None = None):
    """Within it, ``from_pretrained`` quantizes each expert tensor as soon as it is set on its module (on the
    module's device), before the next tensor is read: the float experts are never all in memory at once. This is
    where Axolotl hooks too (transformers' ``core_model_loading.set_param_for_module``); the hook is removed on
    exit. The names quantized are appended to ``done``."""
    import transformers.core_model_loading as loading

    original = loading.set_param_for_module
    targets: dict[int, dict] = {}  # id(model) -> its expert tensors, found once per load
    done = [] if done is None else done

    def set_param(model, target_name, param_value, *args, **kwargs):
        original(model, target_name, param_value, *args, **kwargs)
        if id(model) not in targets:
            targets[id(model)] = expert_tensors(model)
        found = targets[id(model)]
        if target_name in found and param_value.dim() >= 3:
            quantize_tensor(*found[target_name], bits, quant_type, double_quant)
            done.append(target_name)

    loading.set_param_for_module = set_param
    try:
        yield done
    finally:
        loading.set_param_for_module = original


def quantized_experts(model: nn.Module) -> list[str]:
    """Names of the quantized (parametrized, integer-typed) expert tensors in ``model``."""
    return [f"{name}.{key}" for name, module in model.named_modules() if P.is_parametrized(module)
            for key, chain in module.parametrizations.items() if not chain.original.is_floating_point()]
