"""The router's load-balancing loss (``output_router_logits=True``) over the global batch, as one process has it.

transformers adds ``router_aux_loss_coef * aux`` to a MoE model's loss, where (Switch Transformer)
``aux = E * sum_e (n_e / N) * (P_e / N)``: ``n_e`` the top-k assignments to expert e, ``P_e`` the router
probabilities summed over the tokens, ``N`` the non-padding tokens, over every layer. Each rank computes it on its
own tokens; summed over the data-parallel ranks that is neither one process's value nor its gradient. Here the
counts and sums are added over every rank that holds other tokens (dp x cp, the group of the token-mean loss),
so the value is one process's ``aux`` on the global batch, and each rank backpropagates its own tokens' share of
it (``E * sum_e (n_e / N) * (P_e,local / N)``; the counts carry no gradient), whose sum is the global gradient.

transformers has no hook for this and no reduction across ranks in it: this file restates its formula, and checks
that its local value equals the model's own on the first call, so that a family with another formula is refused
rather than silently changed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from nd_parallel.config import ParallelismConfig
from nd_parallel.models import moe
from nd_parallel.models.hf import text_config


def check_model(model: nn.Module, config: ParallelismConfig) -> None:
    """Before any collective: the layouts where the global form is not made yet are refused."""
    if not getattr(text_config(model), "output_router_logits", False):
        return
    for name in ("pp_size", "cp_size"):
        if getattr(config, name) > 1:
            raise NotImplementedError(
                f"output_router_logits=True (the router's load-balancing loss) with {name}={getattr(config, name)} "
                "is not supported yet: that loss is made equal to one process on the global batch under data, "
                f"expert and tensor parallelism only; set {name}=1, or output_router_logits=False in the model "
                "config")


class RouterLoss:
    """Turns a rank's local load-balancing term into its share of the global one (see the module docstring)."""

    def __init__(self, num_experts: int, top_k: int, coef: float):
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.checked = False

    @classmethod
    def for_model(cls, model: nn.Module) -> RouterLoss | None:
        config = text_config(model)
        count = getattr(model, "num_experts", None) or moe.num_experts(model)
        top_k = getattr(model, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
        coef = getattr(model, "router_aux_loss_coef", None)
        coef = coef if coef is not None else getattr(config, "router_aux_loss_coef", None)
        if not count or not top_k or coef is None:
            return None
        return cls(int(count), int(top_k), float(coef))

    def _sums(self, router_logits, attention_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(assignments per expert [E], probabilities summed per expert [E], token rows), over every layer."""
        e = self.num_experts
        device = router_logits[0].device
        counts = torch.zeros(e, dtype=torch.float32, device=device)
        probs = torch.zeros(e, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        for logits in router_logits:
            weights = torch.softmax(logits.float(), dim=-1)  # [T, E]
            mask = (torch.ones(weights.shape[0], device=device) if attention_mask is None
                    else attention_mask.reshape(-1).to(device=device, dtype=torch.float32))
            if mask.numel() != weights.shape[0]:
                raise NotImplementedError(
                    f"router logits of {weights.shape[0]} tokens against an attention mask of {mask.numel()}: "
                    "the load-balancing loss cannot be made global for this model; set output_router_logits=False")
            chosen = torch.topk(weights, self.top_k, dim=-1).indices.reshape(-1)
            counts = counts.scatter_add(0, chosen, mask.repeat_interleave(self.top_k))
            probs = probs + (weights * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
        return counts, probs, rows

    def share(self, router_logits, attention_mask, model_aux: torch.Tensor, group) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
        """(this rank's share of the global term, with its gradient; the global term's value)."""
        counts, probs, rows = self._sums(router_logits, attention_mask)
        e = self.num_experts
        if not self.checked:  # the model's own formula must be the one restated here
            local = e * torch.sum((counts / rows.clamp(min=1)) * (probs / rows.clamp(min=1)))
            if not torch.allclose(local.detach(), model_aux.detach().float(), rtol=1e-4, atol=1e-6):
                raise NotImplementedError(
                    f"this model's load-balancing loss ({float(model_aux):.6g}) is not the Switch-Transformer form "
                    f"({float(local):.6g}) that is made global across ranks; set output_router_logits=False")
            self.checked = True
        total = torch.cat([counts, probs.detach(), rows.reshape(1)])
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        n = total[-1].clamp(min=1)
        fraction = total[:e] / n  # n_e / N over the global batch; no gradient, as in one process
        share = e * torch.sum(fraction * probs / n)
        value = e * torch.sum(fraction * total[e:2 * e] / n)
        return share, value
