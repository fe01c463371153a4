"""Axolotl's ``model_quantization_config`` / ``model_quantization_config_kwargs``: how a pre-quantized checkpoint is
read. Axolotl builds ``transformers.<name>(**kwargs)`` and passes it to from_pretrained as ``quantization_config``.

Implemented: ``Mxfp4Config`` with ``dequantize: true``, what Axolotl's gpt-oss examples write for openai/gpt-oss-*
(experts shipped in MXFP4: ``*_blocks`` / ``*_scales``). transformers turns the blocks into full-precision expert
weights while it reads them (integrations/mxfp4.py, pure torch, on any device; the ranks load in fp32 as always,
so the values are exactly the FP4 grid's), drops the quantization config, and the model is a plain gpt-oss from
then on: every layout and option that trains gpt-oss trains it. Refused with the fix: Mxfp4Config without
dequantize (training through the MXFP4 kernels, whose weights are not parameters) and FineGrainedFP8Config.
"""

from __future__ import annotations

from typing import Any

MXFP4_KWARGS = ("dequantize", "modules_to_not_convert")  # Mxfp4Config's arguments
_DEQUANTIZE = "model_quantization_config_kwargs: {dequantize: true}"


def refusals(d: dict) -> list[str]:
    """The two keys checked as Axolotl reads them (its schema's names, its rule against load_in_4bit / 8bit), and
    only the dequantizing MXFP4 load accepted; refusal lines, each with its fix."""
    name, kwargs = d.get("model_quantization_config"), d.get("model_quantization_config_kwargs")
    if name is None:
        return [] if kwargs in (None, {}) else [
            f"model_quantization_config_kwargs={kwargs!r} without model_quantization_config: they are the "
            "arguments of model_quantization_config (Mxfp4Config); set it or drop them"]
    if name == "FineGrainedFP8Config":
        return ["model_quantization_config='FineGrainedFP8Config': FP8 checkpoints are not loaded (training on FP8 "
                "weights is not implemented): use the bf16 checkpoint, or run the YAML with Axolotl"]
    if name != "Mxfp4Config":
        return [f"model_quantization_config={name!r}: Axolotl knows Mxfp4Config and FineGrainedFP8Config; write "
                f"Mxfp4Config with {_DEQUANTIZE} (gpt-oss' MXFP4 checkpoints, dequantized at load)"]
    if kwargs is not None and not isinstance(kwargs, dict):
        return [f"model_quantization_config_kwargs={kwargs!r}: write a mapping, e.g. {{dequantize: true}}"]
    kwargs = kwargs or {}
    out = [f"model_quantization_config_kwargs.{k}: not an argument of Mxfp4Config; use {', '.join(MXFP4_KWARGS)}"
           for k in kwargs if k not in MXFP4_KWARGS]
    if kwargs.get("dequantize") is not True:
        out.append(f"model_quantization_config=Mxfp4Config without dequantize: true keeps the experts in MXFP4 for "
                   f"transformers' inference kernels, which do not train; add {_DEQUANTIZE} (the experts are "
                   "dequantized as they load, then trained in full precision, as Axolotl's gpt-oss examples do)")
    for key in ("load_in_4bit", "load_in_8bit"):
        if d.get(key):
            out.append(f"model_quantization_config with {key}: the checkpoint is read by one quantizer; Axolotl "
                       f"refuses the pair too: drop {key}")
    return out


def load_kwargs(t) -> dict[str, Any]:
    """from_pretrained's quantization_config for the checked keys (none when unset)."""
    if t.model_quantization_config != "Mxfp4Config":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(**(t.model_quantization_config_kwargs or {}))}
