"""The chunked loss's fast path for a head that is one linear map: ``logits = hidden @ W.T (+ b)`` and nothing after.

That is most causal LMs (an ``lm_head`` Linear, tied to the embedding or not, with or without a bias). For them the
generic path (chunked_loss.py: the model's own forward on each chunk, gradients by ``torch.autograd.grad``) keeps
more than it needs: autograd builds each chunk's log-softmax and its gradient as separate buffers, and hands back the
chunk's own head gradient next to the running sum (two V·h fp32 tensors). Here each chunk is written out in torch
ops instead: one [c, V] fp32 buffer holds the logits, then (in place) their exponentials, the softmax and the
gradient of the chunk's loss sum (softmax − one-hot, rows without a label zero); ``grad_hidden = g @ W`` and the
head's gradient is accumulated in place (``addmm_``) into one fp32 running buffer. So one head gradient and about
one chunk buffer are alive, and the FLOPs are the unchunked loss's (one head matmul forward, two backward).

Why by hand: torch has no fused linear + cross-entropy; Liger's and cut-cross-entropy's are Triton/CUDA kernels
(not on CPU, where the gloo suite runs, and not a dependency of ours) and know nothing of FSDP's unsharded
parameters or autograd's hand-over to ``AccumulateGrad``. The arithmetic is small enough to state here.

Which heads take it is decided once per model from the model itself (``linear_head``): the output-embedding module
is a plain ``nn.Linear`` (its class's forward is Linear's), its weight a plain tensor (a vocabulary-parallel DTensor
head keeps loss_parallel's generic path), no other trainable tensor lies between the decoder and the loss (a LoRA
adapter on the head, a learned scale), and the probe's logits for one position equal ``F.linear(hidden, W, b)``
bit for bit (soft-capping, logit scaling, a forward that rescales the hidden states fail it). Under autocast the
generic path runs (the two would round differently).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from nd_parallel.models.hf import embedding_and_head

from .loss import IGNORE_INDEX

logger = logging.getLogger(__name__)


class LinearHead:
    """A model's output Linear; its weight and bias are read at each use (FSDP swaps unsharded tensors in)."""

    def __init__(self, module: nn.Linear):
        self.module = module

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.module.bias

    def usable(self, hidden: torch.Tensor) -> bool:
        """Per call: same dtype as the hidden states and no autocast (else the generic path rounds as HF does)."""
        bias = self.bias
        return (not torch.is_autocast_enabled(hidden.device.type) and self.weight.dtype == hidden.dtype
                and (bias is None or bias.dtype == hidden.dtype))


def linear_head(model: nn.Module, probe: Callable, hidden: torch.Tensor, params: list[torch.Tensor],
                vocab_parallel: bool) -> LinearHead | None:
    """The model's head as a ``LinearHead`` if it is one linear map and nothing else (module docstring), else None.
    ``hidden`` are decoder outputs of the real forward; ``params`` the tensors the forward uses after the decoder."""
    _, head = embedding_and_head(model)
    if vocab_parallel or not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return None
    if hasattr(head.weight, "full_tensor") or hidden is None:
        return None
    own = {id(head.weight), id(head.bias)}
    if any(p.requires_grad and id(p) not in own for p in params):
        return None
    found = LinearHead(head)
    last = hidden[:, -1:].detach()
    if not found.usable(last):
        return None
    try:
        with torch.no_grad():
            same = torch.equal(probe(last), F.linear(last, head.weight, head.bias))
    except Exception as err:  # the probe ran in _reproduces already; anything here means: not a plain map
        logger.info("chunked loss: linear fast path off (%s)", err)
        return None
    return found if same else None


def linear_cross_entropy(flat: torch.Tensor, targets: torch.Tensor, chunk: int, head: LinearHead,
                         grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
                         grad_bias: torch.Tensor | None) -> torch.Tensor:
    """Sum over label tokens of the cross-entropy of ``flat @ W.T + b`` [n, h] -> [n, V], ``chunk`` rows at a time.
    Writes the gradients of that sum: ``grad_hidden`` [n, h] (rows), ``grad_weight`` [V, h] and ``grad_bias`` [V]
    (fp32, accumulated). Returns the sum (fp32, 0-d)."""
    weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk):
        target = targets[start:start + chunk]
        keep = target != IGNORE_INDEX
        if not bool(keep.any()):
            continue  # no label token: no loss, no gradient
        piece = flat[start:start + chunk]
        g = _chunk_loss_grad(piece, target, keep, weight, bias, total)  # [c, V] fp32: d(chunk sum)/d(logits)
        low = g if g.dtype == weight.dtype else g.to(weight.dtype)  # HF: the upcast's backward casts back
        if grad_hidden is not None:
            grad_hidden[start:start + chunk] = low @ weight
        if grad_weight is not None:
            if low.dtype == torch.float32:
                grad_weight.addmm_(low.t(), piece)
            else:  # bf16/fp16: torch's CPU matmul has no fp32 output for them; the chunk's product is cast once
                grad_weight.add_(low.t() @ piece)
        if grad_bias is not None:
            grad_bias.add_(low.sum(0, dtype=torch.float32))
        del g, low
    return total


def _chunk_loss_grad(piece: torch.Tensor, target: torch.Tensor, keep: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, total: torch.Tensor) -> torch.Tensor:
    """Adds the chunk's loss sum to ``total``; returns its gradient with respect to the logits, in the logits'
    buffer. Per row: loss = log Σ exp(x) − x[target] = m + log Σ exp(x − m) − x[target], m the row's max."""
    logits = F.linear(piece, weight, bias).float()  # [c, V]; in bf16 the linear in bf16, then upcast, as HF does
    safe = torch.where(keep, target, 0).unsqueeze(1)  # [c, 1]
    picked = logits.gather(1, safe).squeeze(1)
    peak = logits.amax(1, keepdim=True)
    exp = logits.sub_(peak).exp_()  # in place from here on: one [c, V] buffer
    norm = exp.sum(1, keepdim=True)
    rows = (peak + norm.log()).squeeze(1) - picked
    total += torch.where(keep, rows, 0.0).sum()
    grad = exp.div_(norm)  # softmax
    grad.scatter_add_(1, safe, torch.full_like(picked, -1.0).unsqueeze(1))  # − one-hot
    return grad.masked_fill_(~keep.unsqueeze(1), 0.0)  # rows without a label: no loss, no gradient
