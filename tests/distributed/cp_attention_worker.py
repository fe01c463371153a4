"""Rank program for test_cp_attention: ring and Ulysses attention against full-sequence SDPA, many cases.

Usage (under torchrun, 4 ranks): cp_attention_worker.py OUT_JSON
Every rank builds the same global q/k/v (seeded per case) and the reference output and dQ/dK/dV on the whole
padded sequence: SDPA with an explicit boolean mask (full_mask; the test checks it equals transformers'
masking_utils), GQA expanded; eager math for softcap, as gemma2's eager attention does it. It then takes its
shard, runs the kernel and compares its shard of the output and of the gradients.
Rank 0 writes {"errors": {cp: {case: [max |err| of out, dq, dk, dv, dsinks, any non-finite]}}} (maxima over the
case's cp ranks), the bytes one rank sent per call and the seconds per cp.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nd_parallel.distributed.context_parallel.attention import KVMeta, comm_stats, ring_attention, ulysses_attention

B, D, SCALE, WINDOW, SOFTCAP = 2, 16, 0.3, 5, 2.0
MASKS = ("causal", "right_pad", "left_pad", "docs", "window", "softcap", "non_causal", "docs_pad_window", "sinks")


@dataclass(frozen=True)
class Case:
    backend: str  # ring | ulysses
    kernel: str  # math | flash_cpu
    hq: int
    hkv: int
    length: int  # real tokens; padded at the end (valid=False) up to a multiple of the chunk count
    load_balance: bool
    mask: str

    @property
    def name(self) -> str:
        shard = "lb" if self.load_balance else "contig"
        return f"{self.backend}/{self.kernel}/h{self.hq}kv{self.hkv}/S{self.length}/{shard}/{self.mask}"


def cases(cp: int) -> list[Case]:
    """ring with the math kernel: the full product. The other three (backend, kernel) pairs exercise what they
    change, not the whole product again: flash_cpu (no softcap) with GQA only (MHA is its groups == 1 case);
    Ulysses (whose inner attention is the same code as ring's) on load-balanced shards, contiguous ones for the
    plain causal mask."""
    out = []
    lengths = (8 * cp, 8 * cp - 3)  # divides 2*cp / does not (padded at the end)
    for backend, kernel in itertools.product(("ring", "ulysses"), ("math", "flash_cpu")):
        gqa = (4, 2) if backend == "ring" or 2 % cp == 0 else (8, 4)  # ulysses needs kv heads divisible by cp
        heads = (gqa, (4, 4)) if kernel == "math" else (gqa,)
        for (hq, hkv), length, lb, mask in itertools.product(heads, lengths, (True, False), MASKS):
            if kernel == "flash_cpu" and mask == "softcap":
                continue  # the fused kernel has no softcap ('auto' picks math there)
            if backend == "ulysses" and not lb and mask != "causal":
                continue
            out.append(Case(backend, kernel, hq, hkv, length, lb, mask))
    return out


def shard_index(rank: int, cp: int, padded: int, load_balance: bool) -> torch.Tensor:
    if not load_balance:
        n = padded // cp
        return torch.arange(rank * n, (rank + 1) * n)
    c = padded // (2 * cp)  # chunks r and 2cp-1-r
    mirror = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])


def inputs(case: Case, cp: int, seed: int):
    chunks = 2 * cp if case.load_balance else cp
    padded = -(-case.length // chunks) * chunks
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, case.hq, padded, D, generator=g)
    k, v = (torch.randn(B, case.hkv, padded, D, generator=g) for _ in range(2))
    weight = torch.randn(B, case.hq, padded, D, generator=g)  # loss = sum(out * weight)
    valid = torch.ones(B, padded, dtype=torch.bool)
    valid[:, case.length:] = False
    if case.mask in ("right_pad", "docs_pad_window"):
        valid[0, case.length - 5:] = False  # row 0 shorter than row 1
    if case.mask == "left_pad":
        valid[1, :4] = False  # causal: row 1's first 4 queries see no key -> output 0, zero gradients
    position_ids = torch.arange(padded).expand(B, padded).clone()
    if case.mask in ("docs", "docs_pad_window"):  # row 0 packs documents of 5, 7 and the rest; row 1 of 3 and rest
        for row, starts in ((0, (5, 12)), (1, (3,))):
            for s in starts:
                position_ids[row, s:] -= position_ids[row, s].clone()
    return q, k, v, weight, valid, position_ids


def full_mask(case: Case, valid, position_ids) -> torch.Tensor:
    """(B, 1, S, S) bool from the definition, written independently of the kernels: key j is visible from query
    i iff j is real, in the same document, not in the future and within the window (positions inside a
    document). test_cp_attention checks it equals transformers' masking_utils composition for every case."""
    doc = _doc_ids(position_ids)
    pq, pk = position_ids[:, :, None], position_ids[:, None, :]
    mask = valid[:, None, :] & (doc[:, :, None] == doc[:, None, :])
    if case.mask != "non_causal":
        mask = mask & (pk <= pq)
    if case.mask in ("window", "docs_pad_window"):
        mask = mask & (pq - pk < WINDOW)
    return mask[:, None]


def _doc_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """A new document wherever the position does not continue the previous one by +1."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def sinks_for(case: Case, seed: int) -> torch.Tensor | None:
    """gpt-oss' attention sinks: one logit per query head (drawn apart from q/k/v, which stay as without)."""
    return torch.randn(case.hq, generator=torch.Generator().manual_seed(seed + 7)) if case.mask == "sinks" else None


def reference(case: Case, q, k, v, weight, mask, sinks=None):
    """Full-sequence output and gradients; rows that see no key are defined as 0 (and get no gradient). With
    sinks, gpt-oss' eager attention: the sink logit appended to every row's scores, its column dropped after
    the softmax."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.clone().requires_grad_()
    groups = case.hq // case.hkv
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    seen = mask.any(-1, keepdim=True)  # [b, 1, s, 1]
    safe = mask | ~seen  # SDPA would return NaN for an all-False row
    if case.mask in ("softcap", "sinks"):
        s = torch.matmul(q, kk.transpose(-1, -2)) * SCALE
        if case.mask == "softcap":
            s = torch.tanh(s / SOFTCAP) * SOFTCAP
        s = s.masked_fill(~safe, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
        out = torch.matmul(s.softmax(-1)[..., : vv.shape[2]], vv)
    else:
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=safe, scale=SCALE)
    out = out * seen
    (out * weight).sum().backward()
    dsinks = torch.zeros(0) if sinks is None else sinks.grad
    return out.detach(), q.grad, k.grad, v.grad, dsinks


def run_case(case: Case, cp: int, rank: int, group, seed: int) -> list[float]:
    q, k, v, weight, valid, position_ids = inputs(case, cp, seed)
    sinks = sinks_for(case, seed)
    ref = reference(case, q, k, v, weight, full_mask(case, valid, position_ids), sinks)
    padded = valid.shape[1]
    doc = _doc_ids(position_ids) if case.mask in ("docs", "docs_pad_window") else None
    all_real = bool(valid.all())
    metas = []
    for r in range(cp):
        idx = shard_index(r, cp, padded, case.load_balance)
        metas.append(KVMeta(idx, None if all_real else valid[:, idx], None if doc is None else doc[:, idx]))
    idx = metas[rank].index
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    sl = None if sinks is None else sinks.clone().requires_grad_()
    kernel = ring_attention if case.backend == "ring" else ulysses_attention
    out = kernel(ql, kl, vl, group, metas, scale=SCALE, causal=case.mask != "non_causal",
                 sliding_window=WINDOW if case.mask in ("window", "docs_pad_window") else None,
                 softcap=SOFTCAP if case.mask == "softcap" else None, kernel=case.kernel, sinks=sl)
    (out * weight[:, :, idx]).sum().backward()
    mine = (out.detach(), ql.grad, kl.grad, vl.grad)
    errs = [float((a - b[:, :, idx]).abs().max()) for a, b in zip(mine, ref)]
    dsinks = torch.zeros(0) if sl is None else sl.grad.clone()
    dist.all_reduce(dsinks, group=group)  # each rank's share: its query rows (ring) or its heads (Ulysses)
    errs.append(float((dsinks - ref[4]).abs().max()) if dsinks.numel() else 0.0)
    errs = torch.tensor(errs, dtype=torch.float64)
    bad = torch.tensor([float(not all(torch.isfinite(t).all() for t in mine))], dtype=torch.float64)
    errs = torch.cat([errs, bad])
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=group)
    return errs.tolist()


def measure_bytes(cp: int, rank: int, group) -> dict:
    """Bytes one rank sends in one forward and one backward, per backend, for a bf16 GQA case."""
    out = {}
    shape = dict(b=2, hq=8, hkv=4, s=16, d=16)
    for backend, fn in (("ring", ring_attention), ("ulysses", ulysses_attention)):
        torch.manual_seed(0)
        q = torch.randn(2, 8, 16, 16, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 4, 16, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        metas = [KVMeta(shard_index(r, cp, 16 * cp, True)) for r in range(cp)]
        comm_stats.reset()
        y = fn(q, k, v, group, metas, scale=SCALE)
        fwd = comm_stats.forward_bytes
        y.float().sum().backward()
        out[backend] = {"forward": fwd, "backward": comm_stats.backward_bytes, "shape": shape,
                        "finite": bool(torch.isfinite(y.float()).all())}
    return out


def main(out_path: str) -> None:
    """4 ranks. cp=2 over the groups {0, 2} and {1, 3} (strided, as cp sits in a larger mesh: group rank !=
    global rank), each running half of the cp=2 cases at the same time; then cp=4 over a new group of all."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit(f"run on 4 ranks (cp=2 twice, then cp=4), got {world}")
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group, in one order
    everyone = dist.new_group([0, 1, 2, 3])
    mine, half = pairs[rank % 2], rank % 2
    report = {"errors": {}, "bytes": {}, "seconds": {}}
    for cp, group, share in ((2, mine, lambda i: i % 2 == half), (4, everyone, lambda i: True)):
        start = time.perf_counter()
        errors = {case.name: run_case(case, cp, dist.get_rank(group), group, seed=1000 + i)
                  for i, case in enumerate(cases(cp)) if share(i)}
        report["seconds"][cp] = time.perf_counter() - start
        report["errors"][cp] = errors
        report["bytes"][cp] = measure_bytes(cp, dist.get_rank(group), group)
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        merged = {"errors": {2: {}, 4: {}}, "bytes": report["bytes"], "seconds": report["seconds"]}
        for other in gathered:  # errors are already maxima over each case's cp group
            for cp in (2, 4):
                merged["errors"][cp].update(other["errors"][cp])
        with open(out_path, "w") as f:
            json.dump(merged, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
