"""A sequence-classification head (a reward model) under context parallelism.

transformers' ``...ForSequenceClassification`` scores every token with its ``score`` head and keeps, per row, the
logits of the last non-pad token, found from ``input_ids``. Under CP each rank holds a share of the sequence, so that
token is on one rank only and the model's own pooling would pick each shard's last token. Here:

- a pre-hook, run before the batch is cut (sharding.py), keeps the whole rows' ``input_ids``;
- a hook on ``score`` gathers every rank's per-token logits into the whole sequence (differentiable:
  ``token_outputs._GatherSequence`` hands each rank the gradient of its own tokens), picks each row's last non-pad
  token from the whole ``input_ids`` as transformers does, and returns that row's logits at every local position,
  so the model's own pooling, whichever local position it takes, returns what one process returns.

Every cp rank then computes the same loss on the same scores and backpropagates its own tokens' share; FSDP adds
the shares over dp x cp (the cp ranks hold equal weights), which is the whole gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nd_parallel.models.hf import text_config

from .token_outputs import _GatherSequence, gather_sequence


class PooledHead:
    """The two hooks of the module docstring on ``model`` (its ``score`` head), for ``runtime``'s cp group."""

    def __init__(self, model: nn.Module, runtime):
        self.model, self.runtime, self.ids = model, runtime, None
        self.handles = [model.register_forward_pre_hook(self._keep, with_kwargs=True, prepend=True),
                        model.score.register_forward_hook(self._pool)]

    def _keep(self, module, args, kwargs):
        if "nd_cp_valid" not in kwargs:  # not a nested call on an already cut batch
            self.ids = kwargs.get("input_ids", args[0] if args else None)

    def _pool(self, module, args, local: torch.Tensor) -> torch.Tensor:
        ids, self.ids = self.ids, None
        if ids is None:
            raise NotImplementedError(f"{type(self.model).__name__} under context parallelism needs input_ids (its "
                                      "head pools the last non-pad token, found from them); pass input_ids")
        whole = (_GatherSequence.apply(local, self.runtime, ids.shape[1]) if local.requires_grad
                 else gather_sequence(local, self.runtime, ids.shape[1]))
        pad = text_config(self.model).pad_token_id
        if pad is None:  # transformers: the last position
            last = torch.full((ids.shape[0],), ids.shape[1] - 1, device=whole.device)
        else:
            positions = torch.arange(ids.shape[1], device=whole.device, dtype=torch.int32)
            last = (positions * (ids.to(whole.device) != pad).to(torch.int32)).argmax(-1)
        pooled = whole[torch.arange(ids.shape[0], device=whole.device), last]
        return pooled.unsqueeze(1).expand(-1, local.shape[1], *pooled.shape[1:])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
