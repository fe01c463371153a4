"""Axolotl's ``scaling_softmax`` (SSMax, nd_parallel/models/ssmax.py) with ``scaling_softmax_factor`` (s, default
0.43) and ``scaling_softmax_bias`` (b, default 0). Axolotl 0.19 applies it to FlexAttention only (with another
attention it warns and trains without it): here it applies when the YAML asks for flex_attention (which runs as SDPA
on CPU ranks, the same attention), and with another attention one line says it changes nothing, as there.
Context parallelism replaces the model's attention by the ring, which does not scale the queries: refused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class AttentionOptions:
    scaling_softmax: bool = False
    """SSMax: each attention score of query position n times s * log(n) + b (with attn_implementation
    flex_attention, as in Axolotl)."""
    scaling_softmax_factor: float | None = None
    """SSMax's s (Axolotl's default 0.43)."""
    scaling_softmax_bias: float | None = None
    """SSMax's b (Axolotl's default 0.0)."""


def _flex(d: dict) -> bool:
    return d.get("attn_implementation") == "flex_attention" or d.get("flex_attention") is True


def refusals(d: dict) -> list[str]:
    on = d.get("scaling_softmax")
    out = [] if on is None or isinstance(on, bool) else [f"scaling_softmax={on!r}; use true or false"]
    for key in ("scaling_softmax_factor", "scaling_softmax_bias"):
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            out.append(f"{key}={value!r}: write a number")
    if on is True and _flex(d) and (d.get("context_parallel_size") or 1) > 1:
        out.append(f"scaling_softmax with context_parallel_size={d['context_parallel_size']}: the ring attention "
                   "replaces the model's attention and does not scale the queries; drop one of them")
    if on is True and not _flex(d):
        d["scaling_softmax"] = False  # Axolotl's meaning: not applied (notes() says so)
    return out


def notes(d: dict) -> list[str]:
    if d.get("scaling_softmax") is True and not _flex(d):
        return ["scaling_softmax: Axolotl 0.19 applies SSMax to flex_attention only (it warns and trains without it "
                "otherwise); not applied here either: set attn_implementation: flex_attention for it"]
    return []


def install(model, t) -> None:
    if t.scaling_softmax:
        from nd_parallel.models.ssmax import install

        install(model, t.scaling_softmax_factor if t.scaling_softmax_factor is not None else 0.43,
                t.scaling_softmax_bias or 0.0)
