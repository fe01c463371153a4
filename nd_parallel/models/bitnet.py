"""1.58-bit (BitNet b1.58) training, Axolotl's ``use_onebitllms``: every ``nn.Linear`` but ``lm_head`` computes
with ternary weights and 8-bit activations, straight-through, over full-precision master weights.

Per forward (the arithmetic of the ``onebitllms`` package's ``BitNetLinear``, Falcon-E's training recipe):

- weights: one scale per tensor, ``s = 1 / max(mean|W|, 1e-5)``; ``W_q = clamp(floor(W·s + 0.5), -1, 1) / s``;
- activations: one scale per token, ``s = 127 / max(max|x|, 1e-5)`` over the features;
  ``x_q = clamp(floor(x·s + 0.5), -128, 127) / s``;
- ``y = x_q @ W_q^T + b``, with the gradient passed through both roundings unchanged (``v + (q(v) - v).detach()``).

Why written here: onebitllms computes these in Triton kernels that run on CUDA only; these few torch ops compute the
same numbers on any device (CPU ranks included). The swap changes each layer's class only (``BitNetLinear`` is an
``nn.Linear``), so parameters, names, checkpoints, TP/PP plans and an optimizer built before see the same tensors,
and the trained model saves as an ordinary full-precision checkpoint, as with onebitllms.

Layouts: FSDP2 / HSDP / DDP quantize the all-gathered whole weight, PP each stage's layers, CP per-token scales:
all exact. TP is refused: the per-tensor weight scale would be a shard's mean, and a row-wise shard holds a slice
of each token's features (the per-token activation scale).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def ternary_weight(w: torch.Tensor) -> torch.Tensor:
    scale = 1.0 / w.abs().mean().clamp(min=1e-5)
    return torch.clamp(torch.floor(w * scale + 0.5), -1, 1) / scale


def int8_activation(x: torch.Tensor) -> torch.Tensor:
    scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return torch.clamp(torch.floor(x * scale + 0.5), -128, 127) / scale


class BitNetLinear(nn.Linear):
    """An ``nn.Linear`` whose forward uses ternary weights and per-token 8-bit activations (straight-through)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        x_q = x + (int8_activation(x) - x).detach()
        w_q = w + (ternary_weight(w) - w).detach()
        return F.linear(x_q, w_q, self.bias)


def to_bitnet(model: nn.Module) -> list[str]:
    """Make every ``nn.Linear`` of ``model`` except those named ``lm_head`` a ``BitNetLinear`` (onebitllms' rule),
    in place; the names changed. Call after loading, before ``accelerator.prepare``; not with an adapter."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, BitNetLinear) and name.rpartition(".")[2] != \
                "lm_head":  # onebitllms' rule: any Linear (a subclass too, its own forward replaced), lm_head kept
            module.__class__ = BitNetLinear
            changed.append(name)
    return changed
