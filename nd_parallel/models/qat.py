"""Quantization-aware training (QAT, Axolotl's ``qat:``): a model's ``nn.Linear`` layers become torchao's
``FakeQuantizedLinear``, which rounds its weight (and input activations) to the target format in every forward and
lets the gradient through unchanged (straight-through), so the weights learn to survive quantization afterwards.

``prepare_qat(model, QATOptions(...))`` works on any causal LM, with or without ``ParallelismConfig``; call it after
the model loads and before ``accelerator.prepare`` (or PEFT). The swap keeps every ``Parameter`` object and name:
checkpoints, TP/PP plans, tied weights and an optimizer built before still see the same tensors, and the trained
model saves as an ordinary full-precision checkpoint (as Axolotl's, which unfakes the layers before saving;
quantize it afterwards with the same settings, e.g. torchao's post-training quantization).

The formats (Axolotl's ``activation_dtype`` / ``weight_dtype`` pairs, ``COMBOS``):

- int4 weights: torchao's ``Int4WeightFakeQuantizer``, asymmetric groups of ``group_size`` along ``in_features``
  (what Axolotl builds); int8 activations: torchao's ``IntxFakeQuantizer``, asymmetric per token;
- float8 (e4m3): torchao's ``Float8FakeQuantizer``, one scale per row (weights) / per token (activations);
- mxfp4 / nvfp4: ``BlockFakeQuantizer`` here: torchao's ``MXTensor`` / ``NVFP4Tensor`` round trip (fp4 e2m1 values in
  blocks of 32 with an e8m0 scale / of 16 with an e4m3 scale) along the last dim, straight-through. torchao's own
  ``MXFakeQuantizedLinear`` / ``NVFP4FakeQuantizedLinear`` compute the same forward and backward but have no switch
  for ``fake_quant_after_n_steps``, and NVFP4's needs a Blackwell GPU (an fp4 ``_scaled_mm``); this emulation runs
  anywhere. NVFP4 weights keep torchao's per-tensor second-level scale; NVFP4 *activations* do not: a per-tensor
  amax would make each token's rounding depend on which other tokens share its batch (and so on the layout).

What each layout does (the contract: the same numbers as one process on the global batch):
FSDP2 / HSDP / DDP fake-quantize the all-gathered, whole weight (exact); PP fake-quantizes each stage's layers
(exact); CP splits the sequence, and every activation scale is per token (exact); the chunked loss feeds the head
token chunks (exact). TP is refused (``check_qat_layout``): a row-wise shard holds a slice of every token's
features, so per-token activation scales (and MX / NVFP4 blocks) would be taken over partial rows. MoE experts
stored as stacked 3-D parameters are not ``nn.Linear`` and stay unquantized (as with torchao in Axolotl); the
router and any Linear experts are fake-quantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from nd_parallel.config import ConfigError

from .moe import expert_modules

logger = logging.getLogger(__name__)

_ALIASES = {"int4": "int4", "int8": "int8", "float8_e4m3fn": "float8", "fp8": "float8", "float8": "float8",
            "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
# (activation_dtype, weight_dtype) -> what is fake-quantized; Axolotl's valid pairs (utils/quantization.py)
COMBOS = {("int8", "int4"): "int8 per-token activations, int4 group-wise weights",
          (None, "int4"): "int4 group-wise weights only",
          ("float8", "float8"): "float8 per-token activations, float8 per-row weights",
          ("float8", "int4"): "float8 per-token activations, int4 group-wise weights",
          ("mxfp4", "mxfp4"): "MXFP4 activations and weights (blocks of 32)",
          ("nvfp4", "nvfp4"): "NVFP4 activations and weights (blocks of 16)"}
_BLOCK = {"mxfp4": 32, "nvfp4": 16}  # the formats' fixed block sizes (group_size must match)
_KEYS = ("activation_dtype", "weight_dtype", "group_size", "quantize_embedding", "fake_quant_after_n_steps")


@dataclass(frozen=True)
class QATOptions:
    """Axolotl's ``qat:`` mapping (its defaults: weight_dtype int8, group_size 32)."""

    weight_dtype: str = "int8"
    activation_dtype: str | None = None
    group_size: int | None = 32
    """Elements per scale along in_features (int4 weights); mxfp4 must use 32, nvfp4 16. None: the format's own."""
    quantize_embedding: bool = False
    """Fake-quantize the input embedding's weight too (weights only, as Axolotl)."""
    fake_quant_after_n_steps: int | None = None
    """Train this many optimizer steps unquantized first (the fake quantizers off), then fake-quantize."""

    def __post_init__(self):
        pair = (self.activation_dtype, self.weight_dtype)
        if pair not in COMBOS:
            valid = ", ".join(f"{a or 'none'}/{w}" for a, w in COMBOS)
            raise ConfigError(f"activation_dtype={self.activation_dtype!r} with weight_dtype={self.weight_dtype!r} "
                              f"has no fake quantization in torchao; use one of (activation/weight): {valid}")
        block = _BLOCK.get(self.weight_dtype)
        if block and self.group_size not in (None, block):
            raise ConfigError(f"group_size={self.group_size} with {self.weight_dtype}: the format's blocks are "
                              f"{block} elements; set group_size: {block}")
        if self.weight_dtype == "int4" and not (isinstance(self.group_size, int) and self.group_size > 0):
            raise ConfigError(f"group_size={self.group_size!r} with int4 weights: write a positive integer that "
                              "divides every Linear's in_features (e.g. 32)")
        if not isinstance(self.quantize_embedding, bool):
            raise ConfigError(f"quantize_embedding={self.quantize_embedding!r}; use true or false")
        n = self.fake_quant_after_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(f"fake_quant_after_n_steps={n!r}; write a step count >= 0 (or leave it out)")

    @property
    def block(self) -> int | None:
        """Elements per weight scale along in_features (None: one per row)."""
        return _BLOCK.get(self.weight_dtype) or (self.group_size if self.weight_dtype == "int4" else None)

    @classmethod
    def from_dict(cls, value) -> QATOptions:
        """Axolotl's mapping (dtype aliases fp8 / float8 / float8_e4m3fn); a ConfigError names the bad value."""
        if isinstance(value, QATOptions):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"qat={value!r}; write a mapping, e.g. {{activation_dtype: int8, weight_dtype: int4, "
                              "group_size: 32}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ConfigError(f"qat: unknown key(s) {', '.join(map(repr, unknown))}; the keys are {', '.join(_KEYS)}")
        kwargs = {k: v for k, v in value.items() if v is not None or k == "activation_dtype"}
        for key in ("activation_dtype", "weight_dtype"):
            if kwargs.get(key) is not None:
                if str(kwargs[key]) not in _ALIASES:
                    raise ConfigError(f"qat: {key}={kwargs[key]!r}; use one of {', '.join(_ALIASES)}")
                kwargs[key] = _ALIASES[str(kwargs[key])]
        if kwargs.get("weight_dtype") in _BLOCK and "group_size" not in kwargs:
            kwargs["group_size"] = None  # the format's own block, not Axolotl's default 32 (nvfp4 would refuse it)
        return cls(**kwargs)


# -------------------------------------------------------------------------------------------- the quantizers
class _StraightThrough(torch.autograd.Function):
    """Forward: the rounded tensor; backward: the gradient unchanged (the straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, rounded):
        return rounded

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class BlockFakeQuantizer(nn.Module):
    """MXFP4 / NVFP4 fake quantization along the last dim (module docstring); ``enabled`` as torchao's quantizers."""

    def __init__(self, fmt: str, per_tensor_scale: bool = False):
        super().__init__()
        self.fmt, self.per_tensor_scale, self.enabled = fmt, per_tensor_scale, True

    def extra_repr(self) -> str:
        return f"{self.fmt}, per_tensor_scale={self.per_tensor_scale}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        with torch.no_grad():
            flat = x.detach().reshape(-1, x.shape[-1]).contiguous()  # to_mx refuses strided views (a sliced head input)
            if self.fmt == "mxfp4":
                from torchao.prototype.mx_formats.config import ScaleCalculationMode
                from torchao.prototype.mx_formats.mx_tensor import MXTensor

                q = MXTensor.to_mx(flat, elem_dtype=torch.float4_e2m1fn_x2, block_size=32,
                                   scaling_mode=ScaleCalculationMode.RCEIL)  # MXFakeQuantizeConfig's defaults
            else:
                from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

                scale = per_tensor_amax_to_scale(flat.abs().max()) if self.per_tensor_scale else None
                q = NVFP4Tensor.to_nvfp4(flat, per_tensor_scale=scale, is_swizzled_scales=False,
                                         use_triton_kernel=False)
            rounded = q.dequantize(x.dtype).reshape(x.shape)
        return _StraightThrough.apply(x, rounded)


def _quantizers(options: QATOptions, embedding: bool = False) -> tuple[nn.Module | None, nn.Module]:
    """(activation quantizer or None, weight quantizer) for one layer, new modules each call."""
    from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase

    act, weight = options.activation_dtype, options.weight_dtype
    if weight in _BLOCK:
        w = BlockFakeQuantizer(weight, per_tensor_scale=weight == "nvfp4")
    elif weight == "float8":
        w = FakeQuantizerBase.from_config(Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn))
    else:  # int4, with the numerics of the kernel the activations feed (Axolotl's choice for int8 activations: bf16)
        w = FakeQuantizerBase.from_config(Int4WeightFakeQuantizeConfig(
            group_size=options.group_size, activation_dtype=torch.float8_e4m3fn if act == "float8" else torch.bfloat16))
    if embedding or act is None:  # an embedding's "input" is token ids: weights only
        return None, w
    if act in _BLOCK:
        return BlockFakeQuantizer(act, per_tensor_scale=False), w
    if act == "float8":
        return FakeQuantizerBase.from_config(Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)), w
    return FakeQuantizerBase.from_config(IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)), w


# -------------------------------------------------------------------------------------------- the swap
def qat_targets(model: nn.Module, options: QATOptions) -> list[tuple[str, nn.Module]]:
    """(name, module) of every plain nn.Linear (and nn.Embedding with quantize_embedding), checked first."""
    kinds = (nn.Linear, nn.Embedding) if options.quantize_embedding else (nn.Linear,)
    found = [(n, m) for n, m in model.named_modules() if type(m) in kinds]
    if not found:
        raise ConfigError("QAT found no nn.Linear to fake-quantize in the model (already prepared, or quantized "
                          "by bitsandbytes?); call prepare_qat once, on a full-precision model")
    block = options.block
    bad = [f"{n} ({m.weight.shape[-1]})" for n, m in found if block and m.weight.shape[-1] % block]
    if bad:
        raise ConfigError(f"QAT {options.weight_dtype} groups of {block} along the input features do not divide "
                          f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; set group_size to a divisor of "
                          "every layer's in_features (int4), or leave these formats for this model")
    return found


def _fake(module: nn.Module, options: QATOptions) -> nn.Module:
    """The fake-quantized twin of one Linear / Embedding holding the *same* Parameter objects (built on meta)."""
    from torchao.quantization.qat.embedding import FakeQuantizedEmbedding
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    dtype = module.weight.dtype
    if isinstance(module, nn.Linear):
        new = FakeQuantizedLinear(module.in_features, module.out_features, module.bias is not None,
                                  device="meta", dtype=dtype)
        new.activation_fake_quantizer, new.weight_fake_quantizer = _quantizers(options)
        new.bias = module.bias
    else:
        new = FakeQuantizedEmbedding(module.num_embeddings, module.embedding_dim, module.padding_idx,
                                     module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse,
                                     device="meta", dtype=dtype)
        new.weight_fake_quantizer = _quantizers(options, embedding=True)[1]
    new.weight = module.weight
    new.train(module.training)
    return new


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def prepare_qat(model: nn.Module, options: QATOptions | dict | None = None, **kwargs) -> list[str]:
    """Swap ``model``'s Linears (and embedding) for fake-quantized ones, in place; returns the swapped names.

    ``options``: a QATOptions, Axolotl's ``qat:`` mapping, or keyword arguments (``weight_dtype="int4",
    activation_dtype="int8", group_size=32``). With ``fake_quant_after_n_steps`` the quantizers start off: call
    ``set_fake_quant(model, step >= n)`` before each step (nd-parallel train's callback does)."""
    options = QATOptions.from_dict(options if options is not None else kwargs)
    if any(_is_fake(m) for m in model.modules()):
        raise ConfigError("prepare_qat: the model already has fake-quantized layers; call it once")
    targets = qat_targets(model, options)
    for name, module in targets:
        _replace(model, name, _fake(module, options))
    stacked = [f"{e.name}.{p}" for e in expert_modules(model) for p in e.stacked]
    if stacked:
        logger.warning("QAT: %d stacked MoE expert tensors, e.g. %s, are not nn.Linear and train unquantized",
                       len(stacked), stacked[0])
    if options.fake_quant_after_n_steps:
        set_fake_quant(model, False)
    return [name for name, _ in targets]


def _is_fake(module: nn.Module) -> bool:
    return hasattr(module, "weight_fake_quantizer")


def set_fake_quant(model: nn.Module, enabled: bool) -> int:
    """Turn every fake quantizer of ``model`` on or off (off: the layers compute in full precision); returns how
    many layers. Under PP, call it on the model as loaded: its stages hold the same layer objects."""
    layers = [m for m in model.modules() if _is_fake(m)]
    for layer in layers:
        for quantizer in (getattr(layer, "activation_fake_quantizer", None), layer.weight_fake_quantizer):
            if quantizer is not None:
                quantizer.enabled = enabled
    return len(layers)


def convert_qat(model: nn.Module) -> int:
    """Undo ``prepare_qat``: plain nn.Linear / nn.Embedding holding the same (trained) parameters; returns how many."""
    swapped = [(n, m) for n, m in model.named_modules() if _is_fake(m)]
    for name, fake in swapped:
        if isinstance(fake, nn.Linear):
            plain = nn.Linear(fake.in_features, fake.out_features, fake.bias is not None, device="meta")
            plain.bias = fake.bias
        else:
            plain = nn.Embedding(fake.num_embeddings, fake.embedding_dim, fake.padding_idx, device="meta")
        plain.weight = fake.weight
        _replace(model, name, plain)
    return len(swapped)


def check_qat_layout(model: nn.Module, config) -> None:
    """Refuse, before any collective, a layout that cannot fake-quantize exactly (module docstring)."""
    if getattr(config, "tp_size", 1) > 1 and any(_is_fake(m) for m in model.modules()):
        raise ConfigError(f"quantization-aware training with tp_size={config.tp_size}: a row-wise TP shard sees a "
                          "slice of each token's features, so per-token activation scales and MX/NVFP4 blocks would "
                          "be computed on partial rows; use dp_shard_size (FSDP2, which fake-quantizes the whole "
                          "all-gathered weight), context_parallel_size or pipeline_parallel_size instead")
