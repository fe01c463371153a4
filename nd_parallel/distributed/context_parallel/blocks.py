"""Block attention math shared by the ring and Ulysses kernels: masks from token metadata, which blocks to
compute, and the exact forward/backward of one (query rows x key columns) block in fp32.

A block's forward returns its normalised output and log-sum-exp (lse); blocks are merged with lse, so the
result equals softmax over all keys at once. Its backward recomputes the probabilities from the *global*
lse and output (flash-attention 2), so a block's dQ/dK/dV are exact partial sums. Two implementations:
``math`` (torch matmuls; GQA, softcap, any device) and ``flash_cpu`` (torch's fused CPU flash kernel, which
returns the lse; no softcap, K/V heads expanded locally only for the call, never for transport).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class KVMeta:
    """Per-token metadata of one cp rank's local sequence shard (the same for q and for k/v of that shard)."""

    index: torch.Tensor
    """int64 (S_local,): global token index (row position in the padded full sequence), same for all batch rows."""
    valid: torch.Tensor | None = None
    """bool (B, S_local): the token is real (False = padding); None = all real."""
    doc: torch.Tensor | None = None
    """int64 (B, S_local): document id inside a packed row; None = one document per row."""

    def __len__(self) -> int:
        return self.index.shape[0]

    def to(self, device) -> "KVMeta":
        return KVMeta(*(None if t is None else t.to(device) for t in (self.index, self.valid, self.doc)))

    def slice(self, start: int, stop: int) -> "KVMeta":
        cut = slice(start, stop)
        return KVMeta(self.index[cut], None if self.valid is None else self.valid[:, cut],
                      None if self.doc is None else self.doc[:, cut])


def concat_metas(metas: list[KVMeta]) -> KVMeta:
    """The metadata of the shards laid end to end (Ulysses' full sequence, in cp-rank order)."""
    index = torch.cat([m.index for m in metas])
    valid = doc = None
    given = [m.valid for m in metas if m.valid is not None]
    if given:
        batch = given[0].shape[0]
        valid = torch.cat([m.valid if m.valid is not None else _all_true(m, batch) for m in metas], dim=1)
    if any(m.doc is not None for m in metas):
        if not all(m.doc is not None for m in metas):
            raise ValueError("packed-document ids (KVMeta.doc) must be given for every cp rank or for none")
        doc = torch.cat([m.doc for m in metas], dim=1)
    return KVMeta(index, valid, doc)


def _all_true(meta: KVMeta, batch: int) -> torch.Tensor:
    return torch.ones(batch, len(meta), dtype=torch.bool, device=meta.index.device)


def check_mask_args(causal: bool, sliding_window: int | None) -> None:
    if sliding_window is not None and not causal:
        raise NotImplementedError(
            f"sliding_window={sliding_window} with causal=False: transformers' bidirectional window "
            "(|q - k| <= window) is not implemented by the context-parallel kernels; run this model with cp_size=1")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 (a query always sees itself)")


def reference_mask(meta_q: KVMeta, meta_k: KVMeta, *, causal: bool = True,
                   sliding_window: int | None = None) -> torch.Tensor:
    """Bool (B or 1, Sq, Sk): True where key j is visible from query i, as transformers' masking_utils builds it:
    padding_mask_function (key is real), causal_mask_function (k <= q), sliding_window_overlay
    (k > q - window) and packed_sequence_mask_function (same document); positions are global indices."""
    iq = meta_q.index.to(meta_k.index.device)[:, None]  # [sq, 1]
    ik = meta_k.index[None, :]  # [1, sk]
    mask = torch.ones(len(meta_q), len(meta_k), dtype=torch.bool, device=ik.device)
    if causal:
        mask &= ik <= iq
    if sliding_window is not None:
        mask &= ik > iq - sliding_window
    mask = mask[None]  # [1, sq, sk]
    if meta_k.valid is not None:
        mask = mask & meta_k.valid[:, None, :]
    if meta_k.doc is not None:
        mask = mask & (meta_q.doc[:, :, None] == meta_k.doc[:, None, :])
    return mask


# ------------------------------------------------------------------------------------------ block plan
@dataclass
class Block:
    """Query rows [q0, q1) of the local shard against key columns [k0, k1) of a K/V shard."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: torch.Tensor | None  # bool (B or 1, q1-q0, k1-k0); None = every pair visible
    causal: bool = False  # the mask is exactly the top-left lower triangle (a fused kernel's is_causal)


def segments(index: torch.Tensor, max_len: int | None = None) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive global indices, at most ``max_len`` long: (start, stop, first index, last index).
    A load-balanced shard is two runs (chunks r and 2cp-1-r; for r = cp-1 they touch, hence max_len)."""
    idx = index.tolist()
    runs, start = [], 0
    for i in range(1, len(idx) + 1):
        if i == len(idx) or idx[i] != idx[i - 1] + 1 or (max_len and i - start == max_len):
            runs.append((start, i, idx[start], idx[i - 1]))
            start = i
    return runs


def plan_blocks(meta_q: KVMeta, meta_k: KVMeta, *, causal: bool, sliding_window: int | None) -> list[Block]:
    """The blocks worth computing for the local queries against one K/V shard, per pair of runs (at most half a
    shard each): pairs that causality, the window, padding or documents rule out entirely are skipped (the
    load-balanced causal ring then computes half a shard pair per off-diagonal step, as zigzag ring attention
    does); a diagonal pair whose mask is the plain triangle is flagged ``causal``; fully visible pairs that
    touch are merged into one larger block."""
    k_runs = segments(meta_k.index, -(-len(meta_k) // 2))
    blocks: list[Block] = []
    for q0, q1, qlo, qhi in segments(meta_q.index, -(-len(meta_q) // 2)):
        for k0, k1, klo, khi in k_runs:
            if (causal and klo > qhi) or (sliding_window is not None and khi <= qlo - sliding_window):
                continue  # ruled out by the index bounds alone
            mask = reference_mask(meta_q.slice(q0, q1), meta_k.slice(k0, k1), causal=causal,
                                  sliding_window=sliding_window)
            if not bool(mask.any()):
                continue  # e.g. every key of the run is padding or another document
            if bool(mask.all()):
                _add_full(blocks, Block(q0, q1, k0, k1, None))
            else:
                tri = (qlo == klo and q1 - q0 == k1 - k0
                       and bool((mask == torch.ones_like(mask[0]).tril()).all()))
                blocks.append(Block(q0, q1, k0, k1, mask, causal=tri))
    return blocks


def _add_full(blocks: list[Block], new: Block) -> None:
    """Append a fully visible block, merged with an earlier fully visible one it extends (same rows and adjacent
    keys, or same keys and adjacent rows): fewer, larger matmuls."""
    for b in reversed(blocks):
        if b.mask is not None:
            continue
        if (b.q0, b.q1) == (new.q0, new.q1) and b.k1 == new.k0:
            b.k1 = new.k1
            return
        if (b.k0, b.k1) == (new.k0, new.k1) and b.q1 == new.q0:
            b.q1 = new.q1
            return
    blocks.append(new)


# ------------------------------------------------------------------------------------------ merge
def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (out, lse) <- softmax-merge with a block's (out_b, lse_b). Rows with no visible key so far have
    lse -inf and out 0; they stay 0 (no NaN) until a block brings a visible key."""
    new = torch.logaddexp(lse, lse_b)
    ref = torch.where(new == NEG_INF, 0.0, new)  # both -inf: weights exp(-inf) = 0 instead of NaN
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - ref).unsqueeze(-1))
    lse.copy_(new)


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """In place: add an attention sink per head (gpt-oss' ``s_aux``) to the softmax of every query row.

    transformers appends the sink logit to each row's scores and drops its column after the softmax: a key of
    logit ``sinks[h]`` and value 0. So it only enlarges the normaliser: lse' = logaddexp(lse, sink), and the output
    shrinks by exp(lse - lse'). Done once per row, on the rank that holds the query, after every key block."""
    sink = sinks.float().view(1, -1, 1)
    new = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    lse.copy_(new)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks[h] for the local query rows: -sum over rows of P_sink * rowsum(dO * O), with P_sink =
    exp(sink - lse) and out, lse the final (sink-merged) ones. A row's output is sum_j P_j v_j and every P_j
    scales by (1 - ...) as the sink grows: dO/dsink = -P_sink * O. The per-rank partial sums add up over the
    cp ranks like every other replicated parameter's gradient."""
    delta = (dout.float() * out.float()).sum(-1)  # [b, h, s]
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2))


def backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse for recomputing P = exp(s - lse): +inf on rows that saw no key, so their P is 0 (not exp(nan))."""
    return torch.where(lse == NEG_INF, float("inf"), lse)


# ------------------------------------------------------------------------------------------ math kernel
def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None):
    """q [b, hq, sq, d], k [b, hkv, sk, d] -> scores [b, hkv, g*sq, sk] (fp32) and tanh(s/softcap) or None."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    q_flat = q.reshape(b, hkv, (hq // hkv) * sq, d)  # GQA: the g query heads of a kv head share its matmul
    s = torch.matmul(q_flat, k.transpose(-1, -2)).mul_(scale)
    t = None
    if softcap is not None:  # gemma2: tanh after scaling, before the mask
        t = s.div_(softcap).tanh_()
        s = t * softcap
    return s, t, q_flat


def _apply_mask(s: torch.Tensor, mask: torch.Tensor | None, hkv: int) -> torch.Tensor:
    if mask is None:
        return s
    b, _, gsq, sk = s.shape
    sq = mask.shape[1]
    view = s.view(b, hkv, gsq // sq, sq, sk)  # [b, hkv, g, sq, sk]
    view.masked_fill_(~mask[:, None, None], NEG_INF)
    return s


def math_forward(q, k, v, mask, scale, softcap, causal=False):
    """One block in fp32: q [b, hq, sq, d], k/v [b, hkv, sk, d] -> out [b, hq, sq, d], lse [b, hq, sq]."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    s, _, _ = _scores(q, k, scale, softcap)
    s = _apply_mask(s, mask, hkv)
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == NEG_INF, 0.0, m)  # rows without a visible key: exp(-inf - 0) = 0
    p = s.sub_(m).exp_()
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v).div_(torch.where(total == 0, 1.0, total))
    lse = torch.where(total == 0, NEG_INF, m + total.log()).squeeze(-1)
    return out.view(b, hq, sq, d), lse.view(b, hq, sq)


def math_backward(dout, q, k, v, out, lse_bwd, mask, scale, softcap, causal=False):
    """Partial dQ [b, hq, sq, d], dK, dV [b, hkv, sk, d] of one block, given the global out and lse (fp32)."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    s, t, q_flat = _scores(q, k, scale, softcap)
    s = _apply_mask(s, mask, hkv)
    lse_f = lse_bwd.reshape(b, hkv, -1, 1)  # [b, hkv, g*sq, 1]
    p = s.sub_(lse_f).exp_()
    do_flat = dout.reshape(b, hkv, -1, d)
    dv = torch.matmul(p.transpose(-1, -2), do_flat)  # sums over the g query heads of each kv head
    delta = (do_flat * out.reshape(b, hkv, -1, d)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
    ds = torch.matmul(do_flat, v.transpose(-1, -2)).sub_(delta).mul_(p)  # dS = P * (dP - D)
    if t is not None:
        ds.mul_(1 - t * t)  # d/ds softcap * tanh(s / softcap) = 1 - tanh^2
    ds.mul_(scale)
    dq = torch.matmul(ds, k).view(b, hq, sq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q_flat)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------ CPU flash kernel
def _additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, NEG_INF)[:, None]


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def flash_forward(q, k, v, mask, scale, softcap, causal=False):
    """``causal``: the mask is the plain triangle; the kernel's is_causal skips its upper tiles (an explicit
    mask costs about 3x as much on CPU)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # row slices of the shard are strided views
    mask = None if causal else mask
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expand(k, groups), _expand(v, groups), 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    if mask is not None:  # the kernel reports lse 0 for a row with no visible key; the merge needs -inf
        empty = ~mask.any(-1)[:, None]  # [b|1, 1, sq]
        lse = lse.masked_fill(empty, NEG_INF)
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def flash_backward(dout, q, k, v, out, lse_bwd, mask, scale, softcap, causal=False):
    b, hkv, sk, d = k.shape
    groups = q.shape[1] // hkv
    dout, q, k, v, out, lse_bwd = (x.contiguous() for x in (dout, q, k, v, out, lse_bwd))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, _expand(k, groups), _expand(v, groups), out, lse_bwd, 0.0, causal,
        attn_mask=None if causal else _additive(mask, q.dtype), scale=scale)
    if groups > 1:  # [b, hkv*g, sk, d] -> sum over each kv head's g query heads
        dk = dk.view(b, hkv, groups, sk, d).sum(2)
        dv = dv.view(b, hkv, groups, sk, d).sum(2)
    return dq, dk, dv


KERNELS = {"math": (math_forward, math_backward), "flash_cpu": (flash_forward, flash_backward)}


def pick_kernel(name: str, device: torch.device, softcap: float | None):
    """'auto' -> torch's fused CPU flash kernel on CPU without softcap, else the matmul path."""
    if name == "auto":
        name = "flash_cpu" if device.type == "cpu" and softcap is None else "math"
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r}: choose 'auto', 'math' or 'flash_cpu'")
    if name == "flash_cpu" and (device.type != "cpu" or softcap is not None):
        raise NotImplementedError(f"kernel='flash_cpu' runs on CPU without softcap (got device={device.type}, "
                                  f"softcap={softcap}); use kernel='math' or 'auto'")
    return KERNELS[name]
