"""The vocabulary-parallel head and cross-entropy (distributed/vocab_parallel.py) in one process, and its planner term.

On a one-rank tp mesh the head's styles, the DTensor logits and torch's loss_parallel run exactly the code paths of
tp > 1 (the all-reduces go over one rank); the tp2 / fsdp2 x tp2 / pp2 x tp2 / cp2 x tp2 rows of the parity matrix
(tests/distributed/test_parity.py) prove the reduction over ranks. Tolerances: the chunked unit tests' 1e-6 (only the
order of fp32 additions differs from HF's loss).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from transformers import AutoModelForCausalLM

from nd_parallel.distributed import chunked_loss
from nd_parallel.distributed.chunked_loss import ChunkedLoss
from nd_parallel.distributed.vocab_parallel import VocabParallelHead, head_style
from nd_parallel.planner import model_spec
from nd_parallel.planner.layout import Cluster, Layout, Training
from nd_parallel.planner.memory import peak_memory, vocab_share
from nd_parallel.planner.meta import meta_model
from nd_parallel.testing.models import tiny_config

# tied (llama), soft-capped (gemma2), untied with per-head norms (qwen3)
HEADS = {"llama": {}, "gemma2": dict(final_logit_softcapping=5.0), "qwen3": {}}


def _tp_pair(family: str):
    from torch.distributed.device_mesh import init_device_mesh

    from nd_parallel.distributed.tensor_parallel import apply_tp

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(family, **HEADS[family]), attn_implementation="eager")
    mine = copy.deepcopy(ref)
    apply_tp(mine, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    ChunkedLoss(mine, 7)
    return ref, mine


@pytest.mark.parametrize("family", sorted(HEADS))
def test_chunked_loss_is_vocabulary_parallel_and_equals_hf(family, one_rank_group, monkeypatch):
    ref, mine = _tp_pair(family)
    assert isinstance(mine.lm_head.weight, DTensor) and mine.lm_head.weight.placements == (Shard(0),)
    if family == "llama":  # tied: still one parameter after TP
        assert mine.lm_head.weight is mine.model.embed_tokens.weight
    seen = []
    real = chunked_loss.F.cross_entropy

    def spy(logits, *args, **kwargs):
        seen.append(logits.placements if isinstance(logits, DTensor) else None)
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(chunked_loss.F, "cross_entropy", spy)
    ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    a, b = ref(input_ids=ids, labels=labels), mine(input_ids=ids, labels=labels)
    monkeypatch.undo()
    # Every chunk's cross-entropy ran on vocabulary-sharded logits (never gathered): 48 tokens, 7 per chunk.
    assert seen[1:] == [(Shard(1),)] * 7 and b.logits is None
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), mine.parameters()):
        grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        torch.testing.assert_close(grad, p.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{family} {name}: {m}")
    with torch.no_grad():  # evaluation / generate: the full logits, a plain tensor, as before
        e, r = mine(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert type(e.logits) is torch.Tensor and e.logits.shape == r.logits.shape
    torch.testing.assert_close(e.logits, r.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(e.loss, r.loss, rtol=1e-6, atol=1e-6)


def test_head_input_layout_is_a_parameter():
    assert head_style().input_layouts == (Replicate(),)
    assert head_style(Shard(1)).input_layouts == (Shard(1),)  # sequence parallelism's final norm output
    assert isinstance(head_style(), VocabParallelHead)


@pytest.mark.parametrize("bad", [Partial(), Shard(2)])
def test_head_input_layout_it_cannot_take_is_refused(bad):
    with pytest.raises(ValueError, match=r"input layout .* is not one it can take; pass Replicate\(\) .* or Shard\(1\)"):
        head_style(bad)


# ------------------------------------------------------------------------------------------------- planner term
BIG = Cluster(nodes=1, gpus_per_node=8, gpu_memory=10**15)


@pytest.fixture(scope="module")
def llama_spec():  # test_planner.py's untied llama shape: hidden 256, vocab 4096
    return model_spec(meta_model(tiny_config("llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                             num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                             vocab_size=4096, tie_word_embeddings=False)))


def test_planner_logits_term_divides_by_tp_with_chunking(llama_spec):
    spec, V, h = llama_spec, llama_spec.vocab, llama_spec.hidden
    chunked, hf = (Training(seq_len=512, global_batch=2, dtype="fp32", loss_chunk=c) for c in (128, 0))
    tokens = 1024
    def at_loss(train, tp):  # the loss's own moment (the peak may be in the layers' backward: test_planner_backward)
        return peak_memory(spec, train, Layout(1, 1, tp, 1, 1, micro_batch=2), BIG).moments["backward start"]["logits"]

    one, tp2 = (at_loss(chunked, tp) for tp in (1, 2))
    assert one == 4 * 128 * V + 4 * tokens * h + 4 * V * h  # tp=1: the linear fast path (test_linear_loss.py)

    def probe(rows, head_grad):  # the larger of the probe's two moments (planner.memory._probe_loss), fp32, under
        # loss_parallel: the log-softmax's backward (logits, log-softmax output, logits' gradient: 12 bytes per
        # logit) beside the running head gradient, or the chunk's head gradient forming (logits and their
        # gradient: 8 bytes) beside the running sum and the chunk's own
        return max(12 * rows + head_grad, 8 * rows + 2 * head_grad)

    # one chunk's buffers over V/2, the hidden states' gradient whole, the head's gradients over V/2
    assert tp2 == probe(128 * V / 2, 4 * V * h / 2) + 4 * tokens * h
    # HF's loss gathers the logits under TP: nothing divides
    assert at_loss(hf, 2) == 16 * tokens * V
    # one chunk covers the tokens: still vocabulary-parallel
    whole = Training(seq_len=512, global_batch=2, dtype="fp32", loss_chunk=4096)
    assert at_loss(whole, 2) == probe(tokens * V / 2, 4 * V * h / 2) + 4 * tokens * h


def test_planner_vocab_share_follows_what_tp_keeps_replicated(llama_spec):
    import dataclasses

    chunked, lay = Training(seq_len=64, global_batch=2, loss_chunk=32), Layout(1, 1, 2, 1, 1, micro_batch=2)
    assert vocab_share(llama_spec, chunked, lay) == 0.5
    assert vocab_share(llama_spec, dataclasses.replace(chunked, loss_chunk=0), lay) == 1.0
    # a tied head whose embedding the plan does not split stays replicated (tensor_parallel._vocab_entries)
    tied_half = dataclasses.replace(llama_spec, tied=True, embed_tp_sharded=False)
    assert vocab_share(tied_half, chunked, lay) == 1.0
    odd = dataclasses.replace(llama_spec, vocab=4097)
    assert vocab_share(odd, chunked, lay) == 1.0
