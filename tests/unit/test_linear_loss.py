"""The chunked loss's fast path for a linear head (distributed/linear_loss.py) against transformers' unchunked loss.

fp32: loss and the gradients of the hidden states, the weight and the bias to 1e-6 (rtol and atol). The fast path
sums per-chunk sums and writes the softmax as exp(x − m) / Σ, where HF takes exp(log_softmax): the two differ in
the order and rounding of fp32 operations only (a few ulps, ~1e-7 relative), so they are close, not bit-equal.

bf16 (HF's path: the linear in bf16, logits upcast, the cross-entropy in fp32, the logits' gradient g cast back to
bf16 for the matmuls): both compute the same bf16 logits, so the loss agrees to 1e-6. The gradients are bounded
entry by entry with u = 2^-8, one bf16 rounding: each side rounds g to bf16 once (HF g/n, the fast path g, scaling
by 1/n after), which moves ``g @ W`` by at most u·(|g| @ |W|) on each side, 2u·(|g| @ |W|) between them; the
results are rounded once by HF, twice by the fast path (the matmul, then the scaling): 3u·|result|. The weight's
gradient: the same 2u from g, the fast path's per-chunk bf16 products add u·(|g|ᵀ @ |h|) (summed in fp32), one
rounding of the result each: 3u·(|g|ᵀ @ |h|) + 2u·|result|. The bias: 2u·Σ|g| + 2u·|result|.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from nd_parallel.distributed.chunked_loss import ChunkedLoss, chunked_cross_entropy
from nd_parallel.distributed.linear_loss import LinearHead
from nd_parallel.testing.models import tiny_config

N, H, V, CHUNK = 50, 32, 1000, 16  # 4 chunks, the last one short


def _inputs(dtype, bias: bool):
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=bias).to(dtype)
    hidden = (torch.randn(1, N, H) * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (1, N))
    targets[0, :7] = -100  # a prompt
    targets[0, 16:32] = -100  # a whole chunk without labels
    return head, hidden, targets


def _hf(head, hidden, targets):
    """transformers' ForCausalLMLoss on already-shifted targets: the linear in the model dtype, then fp32."""
    logits = head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100, reduction="sum") / (
        targets != -100).sum()


def _fast(head, hidden, targets):
    params = [p for p in head.parameters()]
    return chunked_cross_entropy(LinearHead(head), hidden, targets, CHUNK, params)


def _grads(loss_fn, head, hidden, targets):
    head, hidden = copy.deepcopy(head), hidden.detach().clone().requires_grad_()
    loss = loss_fn(head, hidden, targets)
    loss.backward()
    return [loss, hidden.grad] + [p.grad for p in head.parameters()]


@pytest.mark.parametrize("bias", [False, True])
def test_fast_path_equals_hf_loss_in_fp32(bias):
    head, hidden, targets = _inputs(torch.float32, bias)
    ref, mine = _grads(_hf, head, hidden, targets), _grads(_fast, head, hidden, targets)
    for name, a, b in zip(["loss", "hidden", "weight", "bias"], ref, mine):
        assert b.dtype == a.dtype
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert not mine[1][0, 16:32].any()  # a chunk without labels has no gradient


@pytest.mark.parametrize("bias", [False, True])
def test_fast_path_matches_hf_bf16_path(bias):
    head, hidden, targets = _inputs(torch.bfloat16, bias)
    ref, mine = _grads(_hf, head, hidden, targets), _grads(_fast, head, hidden, targets)
    torch.testing.assert_close(mine[0], ref[0], rtol=1e-6, atol=1e-6)  # same bf16 logits, fp32 loss
    # The bounds of the module docstring, entry by entry, u = 2^-8 (one bf16 rounding).
    logits = head(hidden).detach().float().requires_grad_()
    _hf(lambda x: x, logits, targets).backward()
    g, u = logits.grad.reshape(N, V).abs(), 2.0 ** -8
    h, w = hidden.detach().reshape(N, H).float().abs(), head.weight.detach().float().abs()
    bounds = [(2 * u * (g @ w).reshape(1, N, H), 3), (3 * u * (g.t() @ h), 2), (2 * u * g.sum(0), 2)]
    for name, (bound, finals), a, b in zip(["hidden", "weight", "bias"], bounds, ref[1:], mine[1:]):
        assert b.dtype == torch.bfloat16
        excess = (b.float() - a.float()).abs() - (bound + finals * u * a.float().abs())
        assert excess.max() <= 0, f"{name}: beyond its bound by {excess.max()}"


def test_backward_twice_with_retain_graph_and_once_without():
    head, hidden, targets = _inputs(torch.float32, True)
    ref = _grads(_hf, head, hidden, targets)
    hidden = hidden.detach().clone().requires_grad_()
    loss = _fast(head, hidden, targets)
    loss.backward(retain_graph=True)  # pipelining's split zero-bubble backward runs a node twice
    loss.backward()
    torch.testing.assert_close(hidden.grad, 2 * ref[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, 2 * ref[2], rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


def _installed(family: str, **overrides):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager")
    mine = copy.deepcopy(ref)
    ChunkedLoss(mine, 7)
    ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    return ref, mine, ids


@pytest.mark.parametrize("family, overrides, linear", [
    ("llama", {}, True),  # tied to the embedding
    ("qwen3", {}, True),  # untied
    ("gemma2", dict(final_logit_softcapping=5.0), False),
    ("granite", dict(logits_scaling=3.0), False),
    ("cohere", dict(logit_scale=0.5), False),
])
def test_which_heads_take_the_fast_path(family, overrides, linear):
    ref, mine, ids = _installed(family, **overrides)
    a, b = ref(input_ids=ids, labels=ids), mine(input_ids=ids, labels=ids)
    assert (mine.forward.head.linear is not None) == linear
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)


def test_a_lora_adapter_on_the_head_keeps_the_generic_path():
    """LoRA's B starts at zero, so the head's values equal the plain linear map's: the trainable adapter tensors
    outside {W, b} are what turns the fast path down (else they would get no gradient)."""
    from peft import LoraConfig, get_peft_model

    ref, _, ids = _installed("qwen3")
    peft_ref = get_peft_model(ref, LoraConfig(r=4, target_modules=["lm_head", "q_proj"], init_lora_weights=False))
    model = copy.deepcopy(peft_ref)
    ChunkedLoss(model.base_model.model, 7)
    a = peft_ref(input_ids=ids, labels=ids)
    b = model(input_ids=ids, labels=ids)
    assert model.base_model.model.forward.head.enabled and model.base_model.model.forward.head.linear is None
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(peft_ref.named_parameters(), model.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_planners_loss_term_follows_the_path():
    """planner/memory.py: the fast path's one chunk buffer and one head gradient (fp32; bf16 with the bf16 chunk
    logits and the chunk's bf16 head product beside them); a soft-capped or scaled head keeps the probe's term (the
    larger of its two moments, planner/memory._probe_loss). The fp32 fast-path term is checked against a measured step
    in tests/unit/test_planner.py."""
    from dataclasses import replace

    from nd_parallel.planner import Cluster, Layout, Training, model_spec, peak_memory
    from nd_parallel.planner.meta import meta_model
    from nd_parallel.planner.spec import _linear_head

    def term(spec, dtype):
        train = Training(seq_len=512, global_batch=2, dtype=dtype, loss_chunk=128)
        return peak_memory(spec, train, Layout(1, 1, 1, 1, 1, micro_batch=2), Cluster(1, 8, 10**15)).parts["logits"]

    sizes = dict(hidden_size=256, vocab_size=4096, tie_word_embeddings=False)
    llama = model_spec(meta_model(tiny_config("llama", **sizes)))
    tokens, h, v = 1024, 256, 4096
    assert llama.linear_head
    assert term(llama, "fp32") == 4 * 128 * v + 4 * tokens * h + 4 * v * h
    assert term(llama, "bf16") == 6 * 128 * v + 2 * tokens * h + 6 * v * h
    # the probe's larger moment: the log-softmax's backward (4 fp32 chunk buffers, the running sum) or the head's
    # gradient formed (the logits and their gradient, the running sum and the chunk's own): here they tie
    probe = max(16 * 128 * v + 4 * v * h, 8 * 128 * v + 2 * 4 * v * h)
    assert term(replace(llama, linear_head=False), "fp32") == probe + 4 * tokens * h
    assert term(replace(llama, linear_head=False), "bf16") == max(14 * 128 * v + 4 * v * h, 4 * 128 * v + 6 * v * h) \
        + 2 * tokens * h
    for family, overrides in [("gemma2", dict(final_logit_softcapping=5.0)), ("granite", dict(logits_scaling=3.0)),
                              ("cohere", dict(logit_scale=0.5))]:
        assert not _linear_head(nn.Linear(1, 1), tiny_config(family, **overrides)), family  # what model_spec reads
