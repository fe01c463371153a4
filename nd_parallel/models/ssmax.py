"""Scalable softmax (SSMax, arXiv 2501.19399; Axolotl's ``scaling_softmax``): each attention score of query
position n is multiplied by ``s * log(n) + b`` before the softmax (n the query's position + 1, at least 2), so that
attention does not flatten as the context grows.

Axolotl applies it as a FlexAttention ``score_mod``. The factor depends on the query position only, and the score is
(q . k) x scaling, so multiplying each query vector by its factor gives the same scores (and the same soft-capping,
which acts after the scaling either way) with any attention kernel: here a wrapper registered in transformers'
AttentionInterface scales the queries and calls the model's own kernel (SDPA or eager), with the same mask. The
positions are the ``position_ids`` the model passes to its attention (packed rows: each sample's own), else the query
index; Axolotl reads the first row's position_ids for every row of a batch, which differs only for packed rows.
"""

from __future__ import annotations

import sys

import torch

NAME = "nd_ssmax"


def factors(positions: torch.Tensor, s: float, b: float) -> torch.Tensor:
    """s * log(max(position + 1, 2)) + b, per query position (float32)."""
    n = (positions.to(torch.float32) + 1).clamp(min=2.0)
    return s * torch.log(n) + b


def install(model, s: float = 0.43, b: float = 0.0) -> None:
    """Switch `model`'s attention to its own kernel with SSMax-scaled queries (before any layout is applied)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation or "eager"
    if base == "eager":  # the model's module-level eager function (transformers' own convention)
        inner = sys.modules[type(model).__module__].eager_attention_forward
    else:
        inner = ALL_ATTENTION_FUNCTIONS[base]

    def forward(module, query, key, value, attention_mask, **kwargs):
        length = query.shape[-2]
        positions = kwargs.get("position_ids")
        positions = (torch.arange(length, device=query.device)[None] if positions is None
                     else positions[..., -length:])
        scale = factors(positions, s, b).to(query.dtype)[:, None, :, None]  # (batch, 1, queries, 1)
        return inner(module, query * scale, key, value, attention_mask, **kwargs)

    AttentionInterface.register(NAME, forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(NAME)
