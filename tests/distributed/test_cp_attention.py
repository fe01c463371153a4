"""Attention-level parity of the context-parallel kernels (issue 4, item 7), and their single-process checks.

One torchrun launch of 4 ranks (cp_attention_worker.py) runs every case twice over: cp=2 on the strided
groups {0, 2} and {1, 3}, then cp=4. Ring with the math kernel runs the full product (GQA | MHA) x (length
dividing 2*cp | not, padded) x (load-balanced | contiguous shards) x mask (causal, right padding, left
padding with query rows that see nothing, packed documents, sliding window, softcap, non-causal, documents +
padding + window, gpt-oss' attention sinks); the flash_cpu kernel and Ulysses run the parts of it they change
(worker.cases). Output and dQ/dK/dV (and d sinks) are compared with full-sequence SDPA (eager math for softcap and
sinks) in fp32, atol 1e-5.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest
import torch

from nd_parallel.distributed.context_parallel.attention import (
    KVMeta,
    check_ulysses_heads,
    local_attention,
    plan_blocks,
    reference_mask,
    ring_attention,
)
from nd_parallel.fault.launch import launch
from tests.distributed import cp_attention_worker as worker

ATOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_attention") / "result.json"
    start = time.time()
    launch("tests/distributed/cp_attention_worker.py", 4, [str(out)], timeout=240, capture=True)
    data = json.loads(out.read_text())
    data["launch_s"] = time.time() - start
    return data


@pytest.mark.parametrize("cp", [2, 4])
def test_kernels_match_full_sdpa(run, cp):
    errors = run["errors"][str(cp)]
    assert sorted(errors) == sorted(c.name for c in worker.cases(cp))  # every case ran
    worst = defaultdict(lambda: [0.0] * 5)  # (backend, kernel, mask) -> max error of out, dq, dk, dv, dsinks
    for name, (*errs, non_finite) in errors.items():
        backend, kernel, *_, mask = name.split("/")
        worst[backend, kernel, mask] = [max(a, b) for a, b in zip(worst[backend, kernel, mask], errs)]
    print(f"\ncp={cp}: {len(errors)} cases in {run['seconds'][str(cp)]:.1f}s (launch {run['launch_s']:.0f}s); "
          "max |error| of out / dq / dk / dv / dsinks")
    for key, errs in sorted(worst.items()):
        print(f"  {'/'.join(key):32s} " + "  ".join(f"{e:.1e}" for e in errs))
    bad = {name: e for name, e in errors.items() if max(e[:5]) > ATOL or e[5]}
    assert not bad, f"{len(bad)} cases off by more than {ATOL} (or not finite): {bad}"


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_sent_match_the_formulas(run, cp):
    measured = run["bytes"][str(cp)]
    shape = measured["ring"]["shape"]
    b, hq, hkv, s, d = (shape[x] for x in ("b", "hq", "hkv", "s", "d"))
    kv_bf16 = 2 * b * hkv * s * d * 2  # one K/V shard, bf16, un-expanded
    kv_fp32 = kv_bf16 * 2  # the dK/dV accumulator travels in fp32
    assert measured["ring"]["forward"] == (cp - 1) * kv_bf16
    assert measured["ring"]["backward"] == (cp - 1) * kv_bf16 + cp * kv_fp32
    qkvo = b * s * d * (2 * hq + 2 * hkv) * 2  # q, k, v and out of one rank, bf16
    assert measured["ulysses"]["forward"] == measured["ulysses"]["backward"] == qkvo * (cp - 1) // cp
    assert measured["ring"]["finite"] and measured["ulysses"]["finite"]


# ------------------------------------------------------------------------- single process, no process group
def test_check_ulysses_heads():
    check_ulysses_heads(8, 4, 4)
    check_ulysses_heads(4, 2, 2)
    with pytest.raises(ValueError, match=r"num_attention_heads=8 and num_key_value_heads=2 .* by 4.*"
                                         r"cp_backend='ring'.*cp_size in \[2\]"):
        check_ulysses_heads(8, 2, 4)
    with pytest.raises(ValueError, match="num_attention_heads=6 and num_key_value_heads=6 .* by 4"):
        check_ulysses_heads(6, 6, 4)
    with pytest.raises(ValueError, match="no cp_size > 1 divides both"):
        check_ulysses_heads(7, 1, 7)


@pytest.mark.parametrize("mask", worker.MASKS)
@pytest.mark.parametrize("length", [16, 13])
def test_worker_mask_is_transformers_mask(mask, length):
    """The parity reference's mask equals transformers' masking_utils composition (create_causal_mask /
    create_sliding_window_causal_mask: remap positions for packed rows, same-document rule, padding), and the
    kernels' reference_mask over global indices gives the same."""
    from transformers import masking_utils as mu

    case = worker.Case("ring", "math", 4, 2, length, True, mask)
    _, _, _, _, valid, position_ids = worker.inputs(case, 2, seed=0)
    padded = valid.shape[1]
    if mask == "non_causal":
        fn = mu.bidirectional_mask_function
    elif mask in ("window", "docs_pad_window"):
        fn = mu.sliding_window_causal_mask_function(worker.WINDOW)
    else:
        fn = mu.causal_mask_function
    packed = mu.find_packed_sequence_indices(position_ids)
    if packed is not None:
        fn = mu.and_masks(mu.remap_positions_for_packed_sequence(fn, position_ids),
                          mu.packed_sequence_mask_function(packed))
    expected = mu.sdpa_mask(batch_size=worker.B, q_length=padded, kv_length=padded, mask_function=fn,
                            attention_mask=valid, allow_is_causal_skip=False)
    assert torch.equal(worker.full_mask(case, valid, position_ids), expected)
    meta = KVMeta(torch.arange(padded), valid, None if packed is None else packed)
    ours = reference_mask(meta, meta, causal=mask != "non_causal",
                          sliding_window=worker.WINDOW if "window" in mask else None)
    assert torch.equal(ours.expand(worker.B, -1, -1), expected[:, 0])


@pytest.mark.parametrize("kernel", ["math", "flash_cpu"])
def test_local_attention_empty_rows_and_dtype(kernel):
    """Query rows that see no key give 0 and no NaN gradient; bf16 in, bf16 out."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, 8, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    valid = torch.ones(1, 8, dtype=torch.bool)
    valid[0, :3] = False  # left padding: causal queries 0..2 see nothing
    out = local_attention(q, k, v, KVMeta(torch.arange(8), valid), scale=0.25, kernel=kernel)
    assert out.dtype == torch.bfloat16 and torch.equal(out[0, :, :3].float(), torch.zeros(4, 3, 16))
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad.float()).all() for t in (q, k, v))
    assert torch.equal(q.grad[0, :, :3].float(), torch.zeros(4, 3, 16))
    assert torch.equal(k.grad[0, :, :3].float(), torch.zeros(2, 3, 16))  # padding keys get nothing


def _work(cp: int, padded: int, load_balance: bool) -> list[int]:
    """(query, key) pairs each rank computes over a whole causal ring pass."""
    metas = [KVMeta(worker.shard_index(r, cp, padded, load_balance)) for r in range(cp)]
    return [sum((b.q1 - b.q0) * (b.k1 - b.k0) for m in metas for b in
                plan_blocks(metas[r], m, causal=True, sliding_window=None)) for r in range(cp)]


def test_plan_balances_load_balanced_shards():
    """Load-balanced shards: every rank computes the same number of pairs, and every off-diagonal ring step is
    half a shard pair (the zigzag pattern); with contiguous shards rank r computes r full blocks and a
    diagonal one (3/4 of a block: the runs are half shards), so rank cp-1 does 3.4x rank 0's work at cp=4."""
    cp, padded = 4, 64
    balanced, contiguous = _work(cp, padded, True), _work(cp, padded, False)
    assert len(set(balanced)) == 1
    chunk = padded // (2 * cp)
    assert balanced[0] == 3 * chunk * chunk + (cp - 1) * 2 * chunk * chunk  # diagonal step: 3 chunk pairs
    assert contiguous == [16 * 16 * r + 3 * 8 * 8 for r in range(cp)]
    metas = [KVMeta(worker.shard_index(r, cp, padded, True)) for r in range(cp)]
    diagonal = plan_blocks(metas[1], metas[1], causal=True, sliding_window=None)
    assert [(b.q0, b.q1, b.k0, b.k1, b.causal, b.mask is None) for b in diagonal] == [
        (0, 8, 0, 8, True, False), (8, 16, 0, 8, False, True), (8, 16, 8, 16, True, False)]
    earlier = plan_blocks(metas[1], metas[0], causal=True, sliding_window=None)  # all queries x first chunk
    later = plan_blocks(metas[1], metas[2], causal=True, sliding_window=None)  # second chunk x all keys
    assert [(b.q0, b.q1, b.k0, b.k1, b.mask is None) for b in earlier] == [(0, 16, 0, 8, True)]
    assert [(b.q0, b.q1, b.k0, b.k1, b.mask is None) for b in later] == [(8, 16, 0, 16, True)]


def test_bad_inputs_are_refused_before_any_communication():
    q, k = torch.zeros(1, 4, 8, 8), torch.zeros(1, 3, 8, 8)
    meta = KVMeta(torch.arange(8))
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        ring_attention(q, k, k, None, [meta], scale=1.0)
    k = torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError, match="metadata for 2 shards but the cp group has 1"):
        ring_attention(q, k, k, None, [meta, meta], scale=1.0)
    with pytest.raises(ValueError, match="S_local=8"):
        ring_attention(q, k, k, None, [KVMeta(torch.arange(6))], scale=1.0)
    with pytest.raises(NotImplementedError, match="causal=False"):
        ring_attention(q, k, k, None, [meta], scale=1.0, causal=False, sliding_window=4)
    with pytest.raises(NotImplementedError, match="kernel='flash_cpu' runs on CPU without softcap"):
        ring_attention(q, k, k, None, [meta], scale=1.0, softcap=30.0, kernel="flash_cpu")
