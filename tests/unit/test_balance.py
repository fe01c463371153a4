"""Unit tests for nd_parallel.distributed.pipeline.balance: the exact partition, profiling a real HF model, agreement."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from nd_parallel.distributed.pipeline.balance.collective import agree_costs, check_same_split, profile_plan
from nd_parallel.distributed.pipeline.balance.measure import profile_layers, sample_batch
from nd_parallel.distributed.pipeline.balance.partition import partition, stage_times
from nd_parallel.distributed.pipeline.split import check_layer_counts, uniform_layers


def brute_force(costs, num_stages, allow_empty_ends=True):
    """Every legal split, by enumeration: the smallest slowest stage."""
    num_layers = len(costs) - 2
    best = float("inf")
    for counts in itertools.product(range(num_layers + 1), repeat=num_stages):
        if sum(counts) != num_layers:
            continue
        lo_end = 0 if allow_empty_ends and num_stages > 1 else 1
        ends_ok = counts[0] >= lo_end and counts[-1] >= lo_end
        if not ends_ok or any(c < 1 for c in counts[1:-1]):
            continue
        best = min(best, max(stage_times(costs, list(counts))))
    return best


@pytest.mark.parametrize("allow_empty_ends", [True, False])
def test_partition_matches_brute_force_on_random_cases(allow_empty_ends):
    rng = random.Random(1234)
    for _ in range(300):
        num_layers = rng.randint(1, 7)
        num_stages = rng.randint(1, min(num_layers, 5))
        costs = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(2)]
        costs[1:1] = [rng.uniform(0.1, 5) for _ in range(num_layers)]
        plan = partition(costs, num_stages, allow_empty_ends=allow_empty_ends)
        check_layer_counts(plan.counts, num_layers, num_stages)  # the split.py rules hold
        if not allow_empty_ends:
            assert min(plan.counts) >= 1
        assert plan.stage_seconds == stage_times(costs, plan.counts)
        assert plan.bottleneck == pytest.approx(brute_force(costs, num_stages, allow_empty_ends), rel=1e-12)


def test_integer_costs_exact_optimum():
    rng = random.Random(7)
    for _ in range(200):
        num_layers = rng.randint(2, 8)
        num_stages = rng.randint(2, min(num_layers, 4))
        costs = [rng.randint(0, 9) for _ in range(num_layers + 2)]
        assert partition(costs, num_stages).bottleneck == brute_force(costs, num_stages)


def test_large_vocabulary_moves_layers_off_the_head_stage():
    # vocab 32000 x hidden 256: the head (lm_head + loss) costs ~7 layers, the embedding backward ~1.5.
    costs = [1.5] + [1.0] * 8 + [7.0]
    plan = partition(costs, 4)
    uniform = stage_times(costs, uniform_layers(8, 4))
    assert uniform == [3.5, 2.0, 2.0, 9.0]
    assert plan.counts[-1] == 0 and plan.bottleneck == 7.0  # the head alone is the floor
    assert plan.bottleneck == brute_force(costs, 4)
    assert plan.bottleneck < max(uniform)
    # without empty end stages the best is one layer next to the head
    assert partition(costs, 4, allow_empty_ends=False).bottleneck == 8.0


def test_embedding_dominated_first_stage_can_be_empty():
    costs = [9.0] + [1.0] * 6 + [0.5]
    plan = partition(costs, 3)
    assert plan.counts[0] == 0 and plan.bottleneck == 9.0


def test_ties_keep_the_uniform_split():
    for num_layers, num_stages in [(8, 4), (7, 3), (5, 2), (12, 8), (4, 4)]:
        costs = [0.0] + [1.0] * num_layers + [0.0]
        assert partition(costs, num_stages).counts == uniform_layers(num_layers, num_stages)


def test_tolerance_prefers_uniform_within_noise():
    # Noise-level differences between identical layers must not move layers with a 2% tolerance...
    costs = [0.1] + [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.0] + [0.1]
    assert partition(costs, 4, rtol=0.02).counts == [2, 2, 2, 2]
    # ...but rtol=0 is the exact optimum.
    assert partition(costs, 4).bottleneck == pytest.approx(brute_force(costs, 4))


def test_single_stage_and_one_layer_per_stage():
    assert partition([1.0, 2.0, 3.0, 4.0], 1).counts == [2]
    assert partition([0.0, 1.0, 1.0, 1.0, 0.0], 3).counts == [1, 1, 1]
    assert partition([5.0, 1.0, 1.0, 1.0, 5.0], 3).counts == [0, 3, 0]  # 5, 3, 5 beats 6, 1, 6


@pytest.mark.parametrize("costs, stages, match", [
    ([1.0, 1.0], 1, "embedding, layer costs"),
    ([1.0, 1.0, 1.0, 1.0], 3, "cannot split 2 layers into 3 stages"),
    ([1.0, float("nan"), 1.0], 1, "finite"),
    ([1.0, -1.0, 1.0], 1, "finite and >= 0"),
])
def test_partition_refuses_bad_input(costs, stages, match):
    with pytest.raises(ValueError, match=match):
        partition(costs, stages)


# ------------------------------------------------------------------------------------- profiling
@pytest.fixture(scope="module")
def qwen_untied():
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("qwen3", num_hidden_layers=3), attn_implementation="sdpa")


def test_profile_layers_on_a_real_model(qwen_untied):
    model = qwen_untied
    units = profile_layers(model, sample_batch(model, (2, 16)), repeats=2, warmup=1)
    assert [u.name for u in units] == ["embed", "layer.0", "layer.1", "layer.2", "head"]
    assert all(u.seconds > 0 for u in units)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(u.param_bytes for u in units) == total  # untied: every parameter in exactly one unit
    layer = model.model.layers[0]
    assert units[1].param_bytes == sum(p.numel() * 4 for p in layer.parameters())
    assert all(u.activation_bytes > 0 for u in units[1:])
    # a layer saves at least its input and its MLP intermediate: [2, 16, 64] + [2, 16, 128] fp32
    assert units[1].activation_bytes >= 2 * 16 * (64 + 128) * 4
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradients behind


def test_profile_sees_a_large_vocabulary():
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", vocab_size=32000, num_hidden_layers=2, tie_word_embeddings=False))
    units = profile_layers(model, sample_batch(model, (1, 64)), repeats=3)
    head, layers = units[-1], units[1:-1]
    assert head.seconds > 3 * max(u.seconds for u in layers)
    assert head.param_bytes == 32000 * 64 * 4 + 64 * 4  # lm_head + final norm


def test_sample_batch_is_deterministic_and_capped(qwen_untied):
    a, b = sample_batch(qwen_untied), sample_batch(qwen_untied)
    assert a["input_ids"].shape == (1, 256)  # max_position_embeddings=256 < 512
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].min() >= 1


def test_agree_and_profile_plan_on_one_rank(one_rank_group, qwen_untied):
    assert agree_costs([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert agree_costs([1.0, 5.0], reduce="max") == [1.0, 5.0]
    with pytest.raises(ValueError, match="reduce="):
        agree_costs([1.0], reduce="min")
    check_same_split([1, 2])
    plan, units = profile_plan(qwen_untied, 3, sample_shape=(1, 16), repeats=1)
    costs = [u.seconds for u in units]
    assert len(units) == 5 and sum(plan.counts) == 3
    assert plan.bottleneck <= brute_force(costs, 3) * 1.02 + 1e-12  # optimal within the 2% tolerance
    assert plan.stage_seconds == pytest.approx(stage_times([u.seconds for u in units], plan.counts))
