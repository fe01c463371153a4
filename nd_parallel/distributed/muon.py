"""Muon on sharded parameters: Axolotl's ``optimizer: muon`` (Moonlight's recipe) under FSDP2 / TP / EP / DDP.

Muon (Keller Jordan; Moonshot AI's Moonlight scaling) runs SGD with Nesterov momentum on each 2-D hidden weight
matrix and replaces the update by its orthogonalization, computed with a quintic Newton-Schulz iteration in bf16;
the step is scaled by ``0.2 * sqrt(max(rows, cols))`` so that its RMS matches AdamW's and the same learning rate
serves both. Everything else (embeddings, the LM head, norms, biases, 3-D expert tensors) takes AdamW with Muon's
learning rate and weight decay, except 1-D parameters (norms, biases), which are not decayed, as in the Trainer's
AdamW. Weight decay is decoupled (``p *= 1 - lr * wd``).

Why our own class: ``torch.optim.Muon`` is the same algorithm for 2-D parameters only, with no AdamW part; and on a
DTensor the orthogonalization needs the whole matrix: Newton-Schulz of each rank's shard is not a shard of
Newton-Schulz of the matrix. Here the momentum stays sharded (element-wise, like the parameter); the Nesterov
update is all-gathered (``full_tensor``), orthogonalized, identically on every rank, and each rank keeps its own
slice (``distribute_tensor`` with no source rank slices locally, no communication). The orthogonalization is then
bit-equal to one process's for a bit-equal gradient. Each rank computes it for every matrix (no work split across
ranks, as Dion / distributed Muon do); on 2 CPU ranks the step's cost is the Newton-Schulz matmuls.

Precision of the Newton-Schulz iteration (``ns_dtype``): bf16 on CUDA, as Axolotl and Moonlight run it; fp32 on CPU
ranks, where bf16 matmuls are emulated (slower) on CPUs without bf16 matrix units. bf16 amplifies rounding: a
gradient that differs in its last fp32 bit (another layout's summation order) can change the update by bf16 steps
after the 5 iterations; measured on 2 CPU ranks with bf16 forced, the parameters after 3 steps at lr 1e-3 differed
from one process's by ~1e-4 (losses by 2e-6 relative), against 6e-8 in fp32.

Momentum conventions (Moonlight's, as Axolotl's): ``buf = momentum * buf + grad``, Nesterov ``grad + momentum *
buf``; torch.optim.Muon's EMA form differs by the factor ``1 - momentum``, which the normalization inside
Newton-Schulz removes. The AdamW part is Axolotl's formula (eps added to the uncorrected ``sqrt(v)``, then the bias
corrections), its betas (0.95, 0.95) unless ``adam_beta1`` / ``adam_beta2`` are given.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: the largest slope at zero that stays stable
ADAMW_NAMES = ("embed_tokens", "lm_head", "modules_to_save")  # 2-D, but not hidden matrices (Axolotl's names)


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalization of a 2-D ``g`` (``U V^T`` of its SVD, approximately), computed in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)  # spectral norm <= 1
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def _orthogonalized(update: torch.Tensor, steps: int, dtype) -> torch.Tensor:
    if dtype is None:  # see the module docstring
        dtype = torch.bfloat16 if update.device.type == "cuda" else torch.float32
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype)
    whole = newton_schulz(update.full_tensor(), steps, dtype)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """A 2-D hidden weight matrix (not an embedding, head or saved module copy)."""
    return param.ndim == 2 and not any(n in name for n in ADAMW_NAMES)


class Muon(torch.optim.Optimizer):
    """Param groups carry ``use_muon``; build them with :func:`muon_param_groups`."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, betas: tuple[float, float] = (0.95, 0.95),
                 eps: float = 1e-8, ns_dtype: torch.dtype | None = None):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        betas=betas, eps=eps, use_muon=False, ns_dtype=ns_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            bad = [tuple(p.shape) for p in group["params"] if group["use_muon"] and p.ndim != 2]
            if bad:
                raise ValueError(f"Muon orthogonalizes 2-D matrices; parameters of shapes {bad} are in a use_muon "
                                 "group: put them in an AdamW group (use_muon=False)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon if group["use_muon"] else self._adamw)(p, group)
        return loss

    def _muon(self, p, group) -> None:
        state, m = self.state[p], group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.mul_(m).add_(p.grad)
        update = p.grad.add(buf, alpha=m) if group["nesterov"] else buf
        rows, cols = p.shape
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(_orthogonalized(update, group["ns_steps"], group["ns_dtype"]).to(p.dtype),
               alpha=-group["lr"] * 0.2 * math.sqrt(max(rows, cols)))

    def _adamw(self, p, group) -> None:
        state, (beta1, beta2) = self.state[p], group["betas"]
        if "step" not in state:
            state.update(step=0, exp_avg=torch.zeros_like(p.grad), exp_avg_sq=torch.zeros_like(p.grad))
        state["step"] += 1
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].lerp_(p.grad.square(), 1 - beta2)
        scale = (1 - beta1 ** state["step"]) / (1 - beta2 ** state["step"]) ** 0.5
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(state["exp_avg"] / (group["eps"] + state["exp_avg_sq"].sqrt()), alpha=-group["lr"] / scale)


def muon_param_groups(named_parameters) -> list[dict]:
    """Muon's group, AdamW's group and AdamW's group without weight decay (1-D parameters: norms and biases, which
    the Trainer exempts from decay; Axolotl's factory leaves them out of the optimizer altogether) of the trainable
    parameters (``uses_muon`` decides)."""
    muon, adamw, flat = [], [], []
    for name, p in named_parameters:
        if p.requires_grad:
            (muon if uses_muon(name, p) else flat if p.ndim < 2 else adamw).append(p)
    groups = ({"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False},
              {"params": flat, "use_muon": False, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]
