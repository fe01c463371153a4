"""Entropy-aware focal training (EAFT): each label token's cross-entropy weighted by the entropy of the model's
own top-k prediction at that position, raised to ``alpha`` (Axolotl's ``use_eaft`` / ``eaft_alpha`` / ``eaft_k``).

The weight is computed without gradient from the logits: softmax over the ``k`` largest logits, its entropy
``H = -sum p log(p + 1e-10)``, weight ``H ** alpha``. The loss is ``sum(weight * CE) / num_items_in_batch`` (the
global label-token count ``loss.GlobalTokenLoss`` passes), or the mean over the label tokens without it: the same
normalisation as transformers' ``ForCausalLMLoss``, so every layout's global-token mean holds unchanged.

It is installed as the model's ``loss_function`` (``use_eaft_loss``), with ``ForCausalLMLoss``'s signature, so every
place that computes a causal-LM loss here runs it: the model's own forward (DDP, FSDP2, TP with the gathered
logits, CP, which passes ``shift_labels``), and the pipeline's last stage (``PipelineLoss`` and DeepSpeed's loss
read ``model.loss_function``). The chunked loss computes plain cross-entropy, so it stands aside for a model whose
loss function is not transformers' own (``chunked_loss.ChunkedHead``): EAFT holds each micro-batch's full logits.

Why written here: transformers has no entropy-weighted loss; Axolotl's is a Trainer ``compute_loss_func``, which
the pipeline schedule and our global-token normalisation never call. One difference from Axolotl's: the
cross-entropy is taken on fp32 logits (transformers' own upcast), where Axolotl's takes them in the model's dtype.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from .loss import IGNORE_INDEX


def eaft_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
                        num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
                        shift_labels: torch.Tensor | None = None, *, alpha: float = 1.0, k: int = 20,
                        **kwargs) -> torch.Tensor:
    """``ForCausalLMLoss`` with each label token's cross-entropy weighted by its top-``k`` entropy ** ``alpha``."""
    logits = logits.float()
    if shift_labels is None:  # as transformers: pad the labels by one ignored position, then shift them left
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    targets = shift_labels.reshape(-1).to(flat.device)
    keep = targets != ignore_index
    picked, targets = flat[keep], targets[keep]
    with torch.no_grad():
        top = torch.topk(picked, k=min(k, picked.shape[-1]), dim=-1).values
        probs = F.softmax(top, dim=-1)
        weights = (-(probs * torch.log(probs + 1e-10)).sum(dim=-1)).pow(alpha)
    total = (F.cross_entropy(picked, targets, reduction="none") * weights).sum()
    if num_items_in_batch is None:
        return total / keep.sum().clamp(min=1)  # no label token: 0, where the mean of nothing would be nan
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def use_eaft_loss(model: nn.Module, alpha: float = 1.0, k: int = 20) -> None:
    """Make EAFT ``model``'s loss (transformers' ``loss_function`` setter); call before the layout is applied."""
    if k < 1 or alpha < 0:
        raise ValueError(f"EAFT needs k >= 1 top logits and alpha >= 0, got k={k}, alpha={alpha}; Axolotl's "
                         "defaults are eaft_k: 20, eaft_alpha: 1.0")
    try:  # a forward that computes its own cross-entropy would silently ignore the loss function set here
        calls = "loss_function" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        calls = False
    if not calls:
        raise ValueError(f"use_eaft: {type(model).__name__}'s forward does not compute its loss with "
                         "self.loss_function, so the entropy weights would not apply; train this model without "
                         "use_eaft")
    model.loss_function = functools.partial(eaft_causal_lm_loss, alpha=alpha, k=k)


def is_default_causal_lm_loss(model: nn.Module) -> bool:
    """Whether ``model`` computes transformers' own ``ForCausalLMLoss`` (no loss function of its own was set)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft: the HF model
    own = base.__dict__.get("_loss_function")  # what transformers' loss_function setter stores
    return own is None or own is ForCausalLMLoss
