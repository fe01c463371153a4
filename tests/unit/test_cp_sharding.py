"""Sequence sharding for context parallelism (pure tensor code, no process group)."""

import pytest
import torch

from nd_parallel.distributed.context_parallel.sharding import (
    padded_length,
    rank_chunks,
    shard_batch,
    token_index,
    unshard,
)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("balance", [True, False])
def test_shards_cover_the_sequence_once(cp, balance):
    padded = padded_length(37, cp, balance)
    assert padded % (2 * cp if balance else cp) == 0 and 37 <= padded < 37 + 2 * cp
    held = torch.cat([token_index(r, cp, padded, balance) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(padded))


def test_load_balanced_ranks_hold_a_head_and_a_tail_chunk():
    assert [rank_chunks(r, 4, True) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert token_index(1, 2, 8, True).tolist() == [2, 3, 4, 5]
    assert token_index(0, 2, 8, True).tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("balance", [True, False])
def test_causal_work_is_even_only_with_load_balancing(balance):
    cp, padded = 4, 64
    work = [int((token_index(r, cp, padded, balance) + 1).sum()) for r in range(cp)]  # keys seen per query
    ratio = max(work) / (sum(work) / cp)
    assert (ratio == 1.0) if balance else ratio > 1.7


def test_labels_are_shifted_before_the_cut_and_padding_is_masked():
    ids = torch.arange(1, 8).reshape(1, 7)  # 7 tokens over cp=2 x 2 chunks: padded to 8
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones(1, 7, dtype=torch.long))
    shards = [shard_batch(batch, r, 2, True, pad_token_id=0) for r in range(2)]
    assert shards[0].padded_len == 8 and shards[0].seq_len == 7
    assert shards[0].valid.tolist() == [[True] * 7 + [False]]
    # rank 0 holds tokens 0,1,6,7; its shifted labels are the *next* tokens, -100 past the end
    assert shards[0].kwargs["input_ids"].tolist() == [[1, 2, 7, 0]]
    assert shards[0].kwargs["shift_labels"].tolist() == [[2, 3, -100, -100]]
    assert shards[1].kwargs["shift_labels"].tolist() == [[4, 5, 6, 7]]
    assert shards[1].kwargs["position_ids"].tolist() == [[2, 3, 4, 5]]  # global positions: RoPE unchanged
    assert "attention_mask" not in shards[0].kwargs
    total = sum(int((s.kwargs["shift_labels"] != -100).sum()) for s in shards)
    assert total == 6  # exactly the tokens one process would count


def test_packed_rows_get_document_ids_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    sharded = shard_batch(dict(input_ids=torch.ones(1, 8, dtype=torch.long), position_ids=pos), 0, 2, True)
    assert sharded.doc.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    unpacked = shard_batch(dict(input_ids=torch.ones(1, 8, dtype=torch.long), position_ids=torch.arange(8)[None]), 0, 2, True)
    assert unpacked.doc is None


def test_packing_is_ignored_when_a_padding_mask_is_given_as_transformers_does():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    sharded = shard_batch(dict(input_ids=torch.ones(1, 8, dtype=torch.long), position_ids=pos,
                               attention_mask=torch.ones(1, 8)), 0, 2, True)
    assert sharded.doc is None


def test_unshard_restores_the_order():
    full = torch.arange(2 * 10).reshape(2, 10)
    pieces = []
    for r in range(3):
        pieces.append(shard_batch(dict(input_ids=full), r, 3, True).kwargs["input_ids"])
    assert torch.equal(unshard(pieces, 10, True), full)


def test_sequence_shorter_than_the_chunks_is_refused():
    with pytest.raises(ValueError, match="3 tokens cannot be split over cp_size=2.*at least 4.*cp_load_balance=False"):
        shard_batch(dict(input_ids=torch.ones(1, 3, dtype=torch.long)), 0, 2, True)


def test_four_dimensional_mask_is_refused():
    with pytest.raises(ValueError, match="2-D attention_mask.*4-D mask of shape \\(1, 1, 8, 8\\)"):
        shard_batch(dict(input_ids=torch.ones(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 1, 8, 8)), 0, 2, True)


def test_positions_derived_from_token_ids_are_computed_on_the_whole_rows():
    """RoBERTa-style embeddings number positions from padding_idx + 1, counting non-pad tokens; CP used 0..S-1 for
    them (a silently wrong cp2 on camembert / data2vec-text in the model sweep) and now asks the model, before the
    cut. Models with plain positions keep None (0..S-1)."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.context_parallel.hf import _positions_from_ids
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    roberta = AutoModelForCausalLM.from_config(tiny_sweep_config("camembert", is_decoder=True))
    pad = roberta.config.pad_token_id
    ids = torch.tensor([[5, 6, 7, pad]])
    assert _positions_from_ids(roberta)(ids).tolist() == [[pad + 1, pad + 2, pad + 3, pad]]
    assert _positions_from_ids(AutoModelForCausalLM.from_config(tiny_sweep_config("llama"))) is None
