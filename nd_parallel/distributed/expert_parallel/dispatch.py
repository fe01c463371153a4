"""Token dispatch and combine for expert parallelism: the one part of EP written by hand.

torch has no MoE dispatch (only the all-to-all collective), and transformers' own EP (``GroupedGemmParallel`` /
``RouterParallel``) keeps every token on every rank and all-reduces the partial outputs, which moves ep times more
data than needed and needs all ranks to hold the same tokens. Here each rank keeps its own tokens: the
(token, slot) pairs are sorted by expert, sent to the rank owning that expert with one all-to-all, computed there
by the model's own experts forward on that rank's slice of the experts, and sent back with a second all-to-all.
No pair is ever dropped (no capacity factor), so the result is exactly the one-process computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single


@dataclass
class Routing:
    """Where this rank's (token, slot) pairs go and how many come in, for one MoE layer call."""

    order: torch.Tensor  # [T*K] pair indices sorted by global expert id
    local_ids: torch.Tensor  # [T*K] expert id on its owner rank, in sorted order
    send: list[int]  # pairs sent to each ep rank
    recv: list[int]  # pairs received from each ep rank


def plan_routing(top_k_index: torch.Tensor, per_rank: int, group) -> Routing:
    """Sort the pairs by expert (stable: a token's slots keep their order) and exchange the counts."""
    ep = dist.get_world_size(group)
    flat = top_k_index.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    owner = torch.div(experts, per_rank, rounding_mode="floor")
    send_counts = torch.bincount(owner, minlength=ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return Routing(order, experts - owner * per_rank, send_counts.tolist(), recv_counts.tolist())


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single with autograd (its backward is the reverse exchange)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if x.requires_grad:
        return all_to_all_single(out, x, out_splits, in_splits, group=group)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def dispatch(hidden_states: torch.Tensor, routing: Routing, top_k: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's pairs to their experts' ranks: (rows [R, H], local expert id per row [R])."""
    rows = hidden_states[routing.order // top_k]  # [T*K, H], sorted by expert
    received = _exchange(rows, routing.recv, routing.send, group)
    ids = _exchange(routing.local_ids, routing.recv, routing.send, group)
    return received, ids


def combine(expert_out: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor, group) -> torch.Tensor:
    """The experts' outputs back to their tokens, weighted by the router and summed over the slots: [T, H]."""
    back = _exchange(expert_out, routing.send, routing.recv, group)  # [T*K, H], sorted by expert
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(routing.order.numel(), device=routing.order.device)
    pairs = back[inverse]  # [T*K, H] in (token, slot) order
    tokens, k = top_k_weights.shape
    # As transformers' experts: weight in the router's dtype, sum the slots, back to the activations' dtype.
    weighted = pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(expert_out.dtype)
