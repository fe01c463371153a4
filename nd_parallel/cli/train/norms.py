"""Axolotl's ``fp32_norms`` / ``fp32_norm_classes``: under bf16 / fp16 mixed precision the norm modules (classes
ending in RMSNorm or LayerNorm, or those fp32_norm_classes names: a suffix, or a dotted module.Class) keep fp32
parameters and compute in fp32, each in an FSDP2 group of its own with an fp32 policy whose output returns to the
compute dtype, as Axolotl's shard_norms_fp32 does. The ranks tag the matching modules on the loaded model
(distributed/fsdp.FP32_TAG) and every layout's fully_shard gives them their group (nd_parallel applies fully_shard
under mixed precision in every layout, one-process runs included). In fp32 training the norms are fp32 already: a
line says so.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT = ("RMSNorm", "LayerNorm")


@dataclass(kw_only=True)
class NormOptions:
    fp32_norms: bool = False
    """Keep the norm modules' parameters and compute in fp32 under bf16 / fp16 mixed precision (own FSDP2 groups)."""
    fp32_norm_classes: list[str] | None = None
    """Which modules fp32_norms keeps in fp32: class-name suffixes, or dotted module.Class names (default RMSNorm,
    LayerNorm)."""


def refusals(d: dict) -> list[str]:
    out, on, classes = [], d.get("fp32_norms"), d.get("fp32_norm_classes")
    if on is not None and not isinstance(on, bool):
        out.append(f"fp32_norms={on!r}; use true or false")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) and c.strip()
                                                                       for c in classes)):
        out.append(f"fp32_norm_classes={classes!r}: write a list of class names (suffixes such as RMSNorm, or "
                   "module.Class)")
    elif classes and not on:
        out.append("fp32_norm_classes without fp32_norms: true; set fp32_norms or drop it")
    return out


def notes(d: dict) -> list[str]:
    if d.get("fp32_norms") and not (d.get("bf16") is True or d.get("fp16") or d.get("float16") or d.get("bfloat16")):
        return ["fp32_norms: this run computes in fp32 (no bf16 / fp16 on these ranks), so the norms are fp32 already"]
    return []


def matches(module, patterns) -> bool:
    cls = type(module)
    return any(f"{cls.__module__}.{cls.__name__}" == p if "." in p else cls.__name__.endswith(p) for p in patterns)


def tag(model, t) -> int:
    """Mark the matching modules for their fp32 group (before the layout); the count."""
    if not t.fp32_norms:
        return 0
    from nd_parallel.distributed.fsdp import FP32_TAG

    patterns = t.fp32_norm_classes or DEFAULT
    found = [m for m in model.modules() if matches(m, patterns)]
    for module in found:
        setattr(module, FP32_TAG, True)
    return len(found)
