"""In real multi-rank launches, bad layouts end every rank quickly with the message (never a hang)."""

import json
import time

import pytest

from nd_parallel.fault.launch import launch


@pytest.mark.parametrize(
    "layout,expected",
    [
        (dict(tp_size=4), "but the world size is 2"),  # product of sizes != world size, at attach
        # refused even though tp_size=1 leaves the plan unused: a typo should not wait for the day tp is on
        (dict(dp_shard_size=2, tp_plan={"model.layers.*.mlp.up_proj": "colwize"}), "did you mean 'colwise'"),
    ],
    ids=["product-not-world", "typo-in-plan"],
)
def test_bad_layout_fails_fast_on_every_rank(layout, expected, tiny_models):
    start = time.time()
    with pytest.raises(RuntimeError) as err:
        launch("tests/distributed/error_worker.py", 2, [json.dumps(layout), tiny_models["llama"]],
               timeout=180, capture=True)
    text = str(err.value)
    assert text.count(expected) >= 2, text[-3000:]  # both ranks raised it themselves
    assert time.time() - start < 120


def test_good_layout_prepares(tiny_models):
    out = launch("tests/distributed/error_worker.py", 2, [json.dumps(dict(dp_shard_size=2)), tiny_models["llama"]],
                 timeout=180, capture=True)
    assert out.stdout.count("prepared without error") == 2


def test_heads_not_divisible_fails_fast(tiny_models):
    with pytest.raises(RuntimeError) as err:
        launch("tests/distributed/error_worker.py", 4, [json.dumps(dict(tp_size=4)), tiny_models["llama"]],
               timeout=180, capture=True)
    assert str(err.value).count("tp_size=4 does not divide num_key_value_heads=2") >= 4


@pytest.mark.parametrize(
    "batch,expected",
    [
        (dict(seq_len=3), "a sequence of 3 tokens cannot be split over cp_size=2"),
        (dict(seq_len=8, mask_dims=4), "context parallelism takes a 2-D attention_mask"),
    ],
    ids=["cp-sequence-too-short", "cp-4d-mask"],
)
def test_cp_batch_it_cannot_split_fails_fast_on_every_rank(batch, expected, tiny_models):
    start = time.time()
    with pytest.raises(RuntimeError) as err:
        launch("tests/distributed/error_worker.py", 2, [json.dumps(dict(cp_size=2)), tiny_models["llama"],
                                                        json.dumps(batch)], timeout=180, capture=True)
    text = str(err.value)
    assert text.count("prepared without error") == 2 and "forward without error" not in text
    assert text.count(expected) >= 2, text[-3000:]
    assert time.time() - start < 120
