"""Ulysses (DeepSpeed-Ulysses) attention: an all-to-all turns sequence shards into head shards, each rank runs
exact attention over the full sequence for Hq/cp query heads and Hkv/cp key/value heads, and a second
all-to-all turns the output back into sequence shards.

The full sequence a rank sees is the cp shards laid end to end in rank order, so with load balancing its
tokens are not in index order; the mask is built from the shards' global indices (blocks.concat_metas),
which makes the order irrelevant. Bytes each rank sends per call: (cp-1)/cp of its q, k, v (forward) and of
its output, then the same amounts again in backward (the gradients of those four).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .blocks import KVMeta, check_mask_args, concat_metas
from .ring import check_inputs, check_sinks, comm_stats, local_attention


def check_ulysses_heads(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """Ulysses gives each cp rank whole heads: both head counts must be multiples of cp."""
    if num_heads % cp or num_kv_heads % cp:
        both = [c for c in range(2, max(num_heads, num_kv_heads) + 1) if num_heads % c == 0 and num_kv_heads % c == 0]
        hint = f"a cp_size in {both}" if both else "no cp_size > 1 divides both"
        raise ValueError(
            f"cp_backend='ulysses' splits attention heads over cp_size={cp}, but num_attention_heads={num_heads} "
            f"and num_key_value_heads={num_kv_heads} are not both divisible by {cp}; use cp_backend='ring' "
            f"(any head count) or {hint}")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 of [cp, ...]: out[j] = rank j's in[me]. Its own adjoint."""

    @staticmethod
    def forward(ctx, x, group, phase):
        ctx.group = group
        return _all_to_all(x, group, phase)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, "backward"), None, None


def _all_to_all(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    sent = x.numel() * x.element_size() * (x.shape[0] - 1) // x.shape[0]  # our own slice stays here
    if phase == "forward":
        comm_stats.forward_bytes += sent
    else:
        comm_stats.backward_bytes += sent
    return out


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[n, b, h, s, d] sequence shard -> [n, b, h/cp, cp*s, d] head shard over the rank-ordered sequence."""
    n, b, h, s, d = x.shape
    parts = x.reshape(n, b, cp, h // cp, s, d).permute(2, 0, 1, 3, 4, 5)  # [cp, n, b, h/cp, s, d]: part j -> rank j
    got = _AllToAll.apply(parts, group, "forward")  # got[j]: rank j's tokens of our heads
    return got.permute(1, 2, 3, 0, 4, 5).reshape(n, b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, h/cp, cp*s, d] -> [b, h, s, d]: the inverse of _seq_to_heads for one tensor."""
    b, hc, cs, d = x.shape
    parts = x.reshape(b, hc, cp, cs // cp, d).permute(2, 0, 1, 3, 4)  # [cp, b, h/cp, s, d]: our tokens of rank j
    got = _AllToAll.apply(parts, group, "forward")  # got[j]: head group j of our tokens
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * hc, cs // cp, d)


def ulysses_attention(q, k, v, group, metas: list[KVMeta], *, scale: float, causal: bool = True,
                      sliding_window: int | None = None, softcap: float | None = None,
                      kernel: str = "auto", sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ring_attention; needs Hq and Hkv divisible by the cp group size."""
    cp = dist.get_world_size(group)
    check_inputs(q, k, v, metas, cp)
    check_ulysses_heads(q.shape[1], k.shape[1], cp)
    check_mask_args(causal, sliding_window)
    check_sinks(sinks, q.shape[1])
    q_h = _seq_to_heads(q.unsqueeze(0), group, cp)[0]  # [b, hq/cp, S, d]
    k_h, v_h = _seq_to_heads(torch.stack([k, v]), group, cp)  # one message for K and V
    if sinks is not None:  # this rank now holds query heads [r * Hq/cp, (r+1) * Hq/cp): their sinks
        per_rank = q.shape[1] // cp
        sinks = sinks[dist.get_rank(group) * per_rank:(dist.get_rank(group) + 1) * per_rank]
    out_h = local_attention(q_h, k_h, v_h, concat_metas(metas), scale=scale, causal=causal,
                            sliding_window=sliding_window, softcap=softcap, kernel=kernel, sinks=sinks)
    return _heads_to_seq(out_h, group, cp)
