"""Global-token-mean loss across data-parallel (and context-parallel) ranks.

Each rank's model computes ``sum(local token losses) / N_global`` by passing transformers the global count
as ``num_items_in_batch`` (the hook HF built for gradient accumulation); the reported value is the sum of
those shares over the ranks, the same number everywhere, while each rank backpropagates only its own share.
Data-parallel gradients are then *summed* (fsdp.py), which gives exactly the gradient of the global mean —
also when padding leaves ranks with different numbers of label tokens. A MoE model's router load-balancing term
(``output_router_logits=True``) is made global the same way (router_loss.py).
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.distributed as dist
import torch.nn as nn

from .classification import head_kind
from .router_loss import RouterLoss

IGNORE_INDEX = -100


def count_label_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Tokens that contribute to a causal-LM loss: HF shifts labels left by one, so the first is never used."""
    return (labels[..., 1:] != ignore_index).sum()


class _GlobalValueLocalGrad(torch.autograd.Function):
    """Forward: the sum of ``share`` over ``group``. Backward: the gradient flows to the local share only."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, group) -> torch.Tensor:
        total = share.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def global_value_local_grad(share: torch.Tensor, group) -> torch.Tensor:
    return _GlobalValueLocalGrad.apply(share, group)


def _accepts_num_items(model: nn.Module) -> bool:
    """Whether the model's loss honours ``num_items_in_batch``: its forward names it, or takes ``**kwargs`` and its
    class's forward hands them to transformers' ``loss_function``. Some forwards take ``**kwargs`` and still compute
    their own mean (bart, blenderbot, cpmant: a ``CrossEntropyLoss()`` in the forward); passed the global count they
    would return the rank's own mean, and the sum over ranks would be dp times too large. Those, and any forward
    whose source cannot be read, get the rescaled path (``_post``), exact for any mean over the label tokens."""
    params = inspect.signature(model.forward).parameters.values()
    if any(p.name == "num_items_in_batch" for p in params):
        return True
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes **kwargs through
    if any(p.name == "num_items_in_batch" for p in inspect.signature(base.forward).parameters.values()):
        return True
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "loss_function" in source or "num_items_in_batch" in source


def own_loss_unshifted(model: nn.Module) -> bool:
    """Whether the model's forward computes its own cross-entropy on *unshifted* labels (bart, blenderbot,
    bigbird_pegasus, cpmant: ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``; XLM in its ``pred_layer``,
    ProphetNet in its ``_compute_loss``):
    every label token counts, the first one too, where transformers' causal-LM loss shifts them. Read from the
    source of the class and the forward of its direct children."""
    if _accepts_num_items(model):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # The model's forward and the methods it calls (ProphetNet's _compute_loss), or those of a head module it hands
    # the labels to (XLM's pred_layer).
    return any(_unshifted_cross_entropy(type(m)) for m in (base, *base.children()))


def _unshifted_cross_entropy(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
        # and the class's own methods the forward calls (self._compute_loss(...))
        called = (getattr(cls, name, None) for name in dict.fromkeys(re.findall(r"self\.(\w+)\(", source)))
        source += "".join(inspect.getsource(f) for f in called if inspect.isfunction(f))
    except (OSError, TypeError):
        return False
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("#", "`", "[", ">>>")))
    shifts = re.search(r"shift_(logits|labels)|\b(logits|labels)\[\s*(\.\.\.|:)\s*,\s*(:-1|1:)", code)
    return re.search(r"CrossEntropyLoss\(|\bcross_entropy\(|\bnll_loss\(", code) is not None and shifts is None


class GlobalTokenLoss:
    """Forward hooks that turn a HF causal LM's per-rank mean loss into the global-token mean.

    ``group`` spans every rank whose tokens belong to different parts of the global batch (dp x cp); ranks
    that differ only in tp see the same tokens and are not summed.
    """

    def __init__(self, model: nn.Module, group, given_group=None, ignore_index: int = IGNORE_INDEX):
        self.group = group
        # A caller-given num_items_in_batch counts the rank's whole batch, which cp peers share: add it over
        # the data-parallel ranks only. Counted here, a count covers the rank's own sequence shard: add over dp x cp.
        self.given_group = given_group if given_group is not None else group
        self.ignore_index = ignore_index
        self.signature = inspect.signature(model.forward)
        self.native = _accepts_num_items(model)
        # the model's own mean counts every label token; a token-classification head's labels are not shifted
        self.kind = head_kind(model)
        self.unshifted = own_loss_unshifted(model) or self.kind == "token"
        self._local = None
        self._total = None
        self._mask = None
        self.router = RouterLoss.for_model(model)  # None for a dense model
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _labels(self, args, kwargs):
        if "labels" in kwargs:
            return kwargs["labels"]
        bound = self.signature.bind_partial(*args, **kwargs).arguments
        return bound.get("labels")

    def _pre(self, module, args, kwargs):
        labels = self._labels(args, kwargs)
        if labels is None:
            self._total = None
            return None
        if self.kind == "sequence":  # TRL's RewardTrainer passes none: its loss is made global in plugins/trainer
            raise NotImplementedError(
                f"{type(module).__name__} called with labels under data or context parallelism: its loss is a mean "
                "over this rank's sequences, which transformers computes without the global count; train it with "
                "TRL's RewardTrainer (pairs), or with one process")
        self._mask = kwargs.get("attention_mask")
        given = kwargs.get("num_items_in_batch")
        shifted = kwargs.get("shift_labels")  # context parallelism shifts labels before cutting the sequence
        if given is not None:
            local = given
        elif shifted is not None:
            local = (shifted != self.ignore_index).sum()
        elif self.unshifted:
            local = (labels != self.ignore_index).sum()
        else:
            local = count_label_tokens(labels, self.ignore_index)
        local = torch.as_tensor(local, device=labels.device, dtype=torch.int64).reshape(())
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.given_group if given is not None else self.group)
        # A global batch with no label token gives loss 0 rather than 0/0.
        self._local, self._total = local, total.clamp(min=1)
        if self.native:
            kwargs = dict(kwargs, num_items_in_batch=self._total)
            return args, kwargs
        return None

    def _post(self, module, args, kwargs, output):
        if self._total is None or getattr(output, "loss", None) is None:
            return None
        share = output.loss
        aux = getattr(output, "aux_loss", None)
        routed = isinstance(aux, torch.Tensor) and self.router is not None and bool(getattr(output, "router_logits",
                                                                                              None))
        if routed:
            # The model added its rank-local load-balancing term: replaced by this rank's share of the global one
            # (router_loss.py), after the rescaling below, which is for the token-mean term only.
            aux_share, aux_global = self.router.share(output.router_logits, self._mask, aux, self.group)
            share = share - self.router.coef * aux
        if not self.native:
            # The model averaged over its own tokens: rescale that mean into this rank's share.
            share = share * (self._local.to(share.dtype) / self._total.to(share.dtype))
        if routed:
            share = share + self.router.coef * aux_share.to(share.dtype)
            output.aux_loss = aux_global
        output.loss = global_value_local_grad(share, self.group)
        self._total = None
        return output

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
