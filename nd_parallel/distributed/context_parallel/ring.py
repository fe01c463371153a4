"""Ring attention: every cp rank keeps its queries; K/V shards travel once around the ring.

Forward, step t of cp: rank r holds the K/V of rank (r - t) mod cp. It first posts the send of that block to
r + 1 and the receive of the next one from r - 1, then computes the current block while they travel, and
merges it into its running (output, lse). Backward recomputes each block from the saved lse (nothing
S x S is saved); K/V go around the ring again, each followed by an fp32 dK/dV accumulator that every rank
adds its share to; after cp steps the accumulator arrives back at the shard's owner. Every rank posts the same
sends and receives at every step, whatever blocks it skips, so the ring never waits on a skipped block.

Bytes each rank sends per attention call (K/V in their dtype of e bytes, un-expanded for GQA):
forward (cp-1)·2·B·Hkv·S_local·D·e; backward the same plus cp·2·B·Hkv·S_local·D·4 for the dK/dV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .blocks import KVMeta, backward_lse, check_mask_args, merge, merge_sink, pick_kernel, plan_blocks, sink_grad

TAG_KV, TAG_DKV = 0, 1  # gloo matches point-to-point messages by tag; NCCL keeps per-pair order


@dataclass
class CommStats:
    """Counters of this process's context-parallel attention calls (benchmarks read and reset them). Times are
    host clocks, meaningful on CPU only (CUDA kernels run asynchronously)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    compute_s: float = 0.0  # block math, forward and backward: CPU seconds of the calling thread (all of the
    # math with one intra-op thread, as under the launcher), blind to time spent descheduled on a shared machine
    wait_s: float = 0.0  # wall seconds waiting for messages that compute did not hide
    pairs: int = 0  # (query, key) pairs computed, per head, masked pairs inside computed blocks included

    def reset(self) -> None:
        self.__init__()


comm_stats = CommStats()


def _exchange(send: torch.Tensor, recv: torch.Tensor, group, tag: int, phase: str) -> list:
    """Post send -> next rank and recv <- previous rank of the ring; returns the pending works."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    nbytes = send.numel() * send.element_size()
    if phase == "forward":
        comm_stats.forward_bytes += nbytes
    else:
        comm_stats.backward_bytes += nbytes
    return dist.batch_isend_irecv(ops)


def _wait(works: list | None) -> None:
    if works:
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        comm_stats.wait_s += time.perf_counter() - t0


def _group_layout(group) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, metas, scale, causal, sliding_window, softcap, kernel, sinks):
        cp, rank = _group_layout(group)
        block_fwd, _ = pick_kernel(kernel, q.device, softcap)
        b, hq, s, d = q.shape
        qf = q.float()
        kv = torch.stack([k, v])  # [2, b, hkv, s, d]: one message per step, in the inputs' dtype
        out = torch.zeros(b, hq, s, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float32, device=q.device)
        for t in range(cp):
            works = recv = None
            if t < cp - 1:  # post the next block's transfer before computing this one
                recv = torch.empty_like(kv)
                works = _exchange(kv, recv, group, TAG_KV, "forward")
            t0 = time.thread_time()
            kf, vf = kv[0].float(), kv[1].float()
            blocks = plan_blocks(metas[rank], metas[(rank - t) % cp], causal=causal, sliding_window=sliding_window)
            for blk in blocks:
                q_rows, k_cols = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
                out_b, lse_b = block_fwd(qf[:, :, q_rows], kf[:, :, k_cols], vf[:, :, k_cols], blk.mask, scale,
                                         softcap, blk.causal)
                merge(out[:, :, q_rows], lse[:, :, q_rows], out_b, lse_b)
                comm_stats.pairs += b * (blk.q1 - blk.q0) * (blk.k1 - blk.k0)
            comm_stats.compute_s += time.thread_time() - t0
            _wait(works)
            kv = recv if recv is not None else kv
        if sinks is not None:
            merge_sink(out, lse, sinks)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.group, ctx.metas, ctx.scale, ctx.causal = group, metas, scale, causal
        ctx.sliding_window, ctx.softcap, ctx.kernel = sliding_window, softcap, kernel
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, metas, scale, softcap = ctx.group, ctx.metas, ctx.scale, ctx.softcap
        cp, rank = _group_layout(group)
        _, block_bwd = pick_kernel(ctx.kernel, q.device, softcap)
        qf, dof, outf, lse_bwd = q.float(), dout.float(), out.float(), backward_lse(lse)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv_works = dkv_recv = dkv_sent = None
        for t in range(cp):
            kv_works = kv_recv = None
            if t < cp - 1:
                kv_recv = torch.empty_like(kv)
                kv_works = _exchange(kv, kv_recv, group, TAG_KV, "backward")
            t0 = time.thread_time()
            kf, vf = kv[0].float(), kv[1].float()
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # this step's share
            blocks = plan_blocks(metas[rank], metas[(rank - t) % cp], causal=ctx.causal,
                                 sliding_window=ctx.sliding_window)
            for blk in blocks:
                q_rows, k_cols = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
                dq_b, dk_b, dv_b = block_bwd(dof[:, :, q_rows], qf[:, :, q_rows], kf[:, :, k_cols], vf[:, :, k_cols],
                                             outf[:, :, q_rows], lse_bwd[:, :, q_rows], blk.mask, scale, softcap,
                                             blk.causal)
                dq[:, :, q_rows] += dq_b
                dkv[0, :, :, k_cols] += dk_b
                dkv[1, :, :, k_cols] += dv_b
            comm_stats.compute_s += time.thread_time() - t0
            if dkv_works is not None:  # the accumulator of this K/V shard, from the ranks before us
                _wait(dkv_works)
                dkv += dkv_recv
            if cp > 1:  # pass it on; after the last step this is the trip home to the owner
                dkv_sent, dkv_recv = dkv, torch.empty_like(dkv)  # keep the sent buffer alive until its wait
                dkv_works = _exchange(dkv_sent, dkv_recv, group, TAG_DKV, "backward")
            _wait(kv_works)
            kv = kv_recv if kv_recv is not None else kv
        if cp > 1:
            _wait(dkv_works)
            dkv = dkv_recv
        # The lse and output saved are the sink-merged ones, so the blocks' dQ/dK/dV above already see the sink's
        # share of every row's softmax; only the sink's own gradient is left.
        dsinks = None if sinks is None else sink_grad(dof, outf, lse, sinks).to(sinks.dtype)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None,
                dsinks)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metas: list[KVMeta], cp: int) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q (B, Hq, S, D) and k, v (B, Hkv, S, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d) or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)}: batch, length and head size must match and "
                         f"the query heads must be a multiple of the key/value heads")
    if len(metas) != cp:
        raise ValueError(f"got metadata for {len(metas)} shards but the cp group has {cp} ranks")
    lengths = [len(m) for m in metas]
    if any(n != s for n in lengths):
        raise ValueError(f"every cp rank must hold S_local={s} tokens (pad the full sequence to a multiple of the "
                         f"chunk count); the shards' metadata have lengths {lengths}")


def ring_attention(q, k, v, group, metas: list[KVMeta], *, scale: float, causal: bool = True,
                   sliding_window: int | None = None, softcap: float | None = None,
                   kernel: str = "auto", sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence held by the cp ``group``.

    q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D) in transformers' layout; ``metas[r]`` describes group rank
    r's shard. Returns (B, Hq, S_local, D) in q's dtype. ``kernel``: 'auto' (CPU flash kernel on CPU without
    softcap, else 'math'), 'math' or 'flash_cpu'. ``group=None`` means a single shard (see local_attention).
    Key j is visible from query i iff valid[j], same doc, index_j <= index_i (causal) and
    index_i - index_j < sliding_window: transformers' masking_utils rules on global positions. ``sinks`` (Hq,):
    one attention-sink logit per query head, as gpt-oss' ``s_aux`` (blocks.merge_sink)."""
    cp, _ = _group_layout(group)
    check_inputs(q, k, v, metas, cp)
    check_mask_args(causal, sliding_window)
    check_sinks(sinks, q.shape[1])
    metas = [m.to(q.device) for m in metas]  # masks are built next to the scores (no-op when already there)
    return _RingAttention.apply(q, k, v, group, metas, scale, causal, sliding_window, softcap, kernel, sinks)


def check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"attention sinks of shape {tuple(sinks.shape)} for {heads} query heads: give one sink "
                         "logit per query head this rank computes, shape (Hq,)")


def local_attention(q, k, v, meta: KVMeta, *, scale: float, causal: bool = True, sliding_window: int | None = None,
                    softcap: float | None = None, kernel: str = "auto", sinks=None) -> torch.Tensor:
    """The same exact, masked attention on one process (the whole sequence is local): Ulysses' inner step."""
    return ring_attention(q, k, v, None, [meta], scale=scale, causal=causal, sliding_window=sliding_window,
                          softcap=softcap, kernel=kernel, sinks=sinks)
