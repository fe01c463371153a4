"""loss_chunk_size="auto": the chunk is resolved against the tokens one loss call sees (issue 21).

At run time that is this rank's b·s at the loss: after CP's sequence split, one micro-batch under PP. The planner
resolves the same setting against the same tokens (micro_batch · seq / cp), through ``Training.chunk_tokens``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nd_parallel import ParallelismConfig
from nd_parallel.config.loss import loss_chunk_for
from nd_parallel.distributed import chunked_loss
from nd_parallel.distributed.chunked_loss import ChunkedHead, ChunkedLoss, shifted_targets
from nd_parallel.planner import Cluster, Layout, Training, model_spec, peak_memory
from nd_parallel.planner.meta import meta_model
from nd_parallel.planner.timing import _model_parallel
from nd_parallel.testing.models import tiny_config

BIG = Cluster(nodes=1, gpus_per_node=8, gpu_memory=10**15)


@pytest.mark.parametrize("tokens, chunk", [
    (1, 128), (512, 128), (1024, 128),      # below 1024 tokens: never under 128 (the head's matmul stays large)
    (1025, 129), (1500, 188), (2047, 256),  # 1/8 of the tokens, rounded up
    (2048, 256), (4096, 256), (65536, 256),  # never over 256
])
def test_auto_is_an_eighth_of_the_tokens_within_128_and_256(tokens, chunk):
    assert loss_chunk_for("auto", tokens) == chunk


def test_an_int_stays_that_many_tokens_and_off_stays_off():
    for tokens in (64, 1024, 8192):
        assert loss_chunk_for(64, tokens) == 64 and loss_chunk_for(512, tokens) == 512
        assert loss_chunk_for(0, tokens) == 0 and loss_chunk_for(None, tokens) == 0
    assert ParallelismConfig().loss_chunk_tokens == 256  # the most "auto" ever uses: still on


def _recorded_chunks(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = chunked_loss.chunked_cross_entropy

    def spy(head, hidden, targets, chunk, params, num_items_in_batch=None):
        seen.append(chunk)
        return real(head, hidden, targets, chunk, params, num_items_in_batch)

    monkeypatch.setattr(chunked_loss, "chunked_cross_entropy", spy)
    return seen


def _model():
    torch.manual_seed(0)
    config = tiny_config("llama", max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


@pytest.mark.parametrize("shape, chunk", [
    ((1, 1024), 128),  # CP2 at seq 2048: this rank's loss sees its 1024 tokens
    ((2, 512), 128),   # two samples of 512 (b·s, not s)
    ((1, 1500), 188),
    ((2, 1024), 256),  # the same 2048 tokens unsplit
])
def test_the_loss_call_resolves_auto_from_its_own_tokens(monkeypatch, shape, chunk):
    model = _model()
    ids = torch.randint(1, 256, shape, generator=torch.Generator().manual_seed(0))
    own = model(input_ids=ids, labels=ids).loss
    seen = _recorded_chunks(monkeypatch)
    ChunkedLoss(model, "auto")
    mine = model(input_ids=ids, labels=ids).loss
    assert seen == [chunk]
    torch.testing.assert_close(mine, own, rtol=1e-6, atol=1e-6)  # chunking changes the order of fp32 sums only


def test_a_pipeline_micro_batch_resolves_against_its_own_tokens(monkeypatch):
    """The last pipeline stage calls ``ChunkedHead.loss`` once per micro-batch: a batch of 2 x 1280 tokens in two
    micro-batches of one sample is chunked at 160 (1280 / 8), not at 256 (2560 / 8 capped)."""
    model = _model()
    head = ChunkedHead(model, model.forward, "auto")
    seen = _recorded_chunks(monkeypatch)
    ids = torch.randint(1, 256, (2, 1280), generator=torch.Generator().manual_seed(1))
    for micro in ids.chunk(2):
        _, hidden = head.run(input_ids=micro)
        head.loss(hidden, shifted_targets(micro, None))
    assert seen == [160, 160]
    assert head.chunk_for(ids.numel()) == 256


@pytest.fixture(scope="module")
def llama():
    return model_spec(meta_model(tiny_config("llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                             num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                             vocab_size=4096, tie_word_embeddings=False)))


@pytest.mark.parametrize("seq, layout, chunk", [
    (2048, Layout(1, 2, 1, 1, 1), 256),                                         # FSDP2: 2048 tokens per rank
    (2048, Layout(1, 1, 1, 2, 1), 128),                                         # CP2: 1024 tokens per rank
    (4096, Layout(1, 1, 1, 2, 1), 256),                                         # CP2 at seq 4096: 2048 per rank
    (1280, Layout(1, 1, 1, 1, 2, micro_batch=1, microbatches=2, schedule="1f1b"), 160),  # PP2, one sample each
    (512, Layout(1, 1, 2, 1, 1, micro_batch=4), 256),                           # TP2: 4 x 512 tokens
])
def test_the_planner_resolves_auto_against_the_tokens_per_rank(llama, seq, layout, chunk):
    auto, fixed = (Training(seq_len=seq, global_batch=8, dtype="fp32", loss_chunk=c) for c in ("auto", chunk))
    tokens = layout.micro_batch * seq / layout.cp
    assert auto.chunk_tokens(tokens) == chunk
    parts = [peak_memory(llama, t, layout, BIG).parts["logits"] for t in (auto, fixed)]
    assert parts[0] == parts[1]
    timing = [_model_parallel(llama, t, layout, BIG, llama.num_layers) for t in (auto, fixed)]
    assert timing[0] == timing[1]


def test_the_planner_cp2_logits_term_is_below_an_eighth(llama):
    """Issue 21 at the planner's level: CP2, seq 2048, one sample: auto's term is the 128-token chunk's."""
    layout = Layout(1, 1, 1, 2, 1)
    hf, auto, old = (peak_memory(llama, Training(seq_len=2048, global_batch=1, dtype="fp32", loss_chunk=c), layout,
                                 BIG).parts["logits"] for c in (0, "auto", 256))
    assert auto < old and auto / hf <= 1 / 8
