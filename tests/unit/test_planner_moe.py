"""The planner on mixture-of-experts models: active vs total parameters, experts in memory and time, no traceback."""

from __future__ import annotations

import json

import pytest
import torch

from nd_parallel.planner import model_spec
from nd_parallel.planner.meta import meta_model
from nd_parallel.testing.models import tiny_config

GiB = 2**30


def spec_of(family="llama", **overrides):
    return model_spec(meta_model(tiny_config(family, **overrides)))

QWEN3_MOE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, intermediate_size=512,
                 vocab_size=4096, tie_word_embeddings=False)


def test_moe_spec_counts_experts_active_and_total(recwarn):
    spec = spec_of("qwen3_moe", **QWEN3_MOE)
    assert not [w for w in recwarn if "cannot count" in str(w.message)]  # ops counted on meta (batched experts)
    assert spec.ops.layer_fwd > 0 and spec.ops.adam_foreach > 0
    experts = 16 * 3 * 256 * 64  # gate_up [E, 2I, H] + down [E, H, I]
    assert (spec.num_experts, spec.experts_per_token, spec.moe_layers) == (16, 4, 4)
    assert spec.layer_expert_params == experts and spec.gated_mlp
    assert spec.active_params == spec.total_params - 4 * experts * 12 // 16  # 12 of 16 experts idle per token
    assert spec.ffn == 4 * 64  # the top-k experts' width, what the activations hold
    attn = (256 * 256 + 2 * 256 * 128 + 256 * 256)
    assert spec.layer_matmul_params == attn + experts * 4 // 16  # FLOPs of the active experts only
    assert spec.layer_tp_params == attn + experts  # the plan's moe_tp_experts splits every expert
    assert spec.layer_colwise == 3 + 1 and spec.layer_rowwise == 1 + 1  # q, k, v, o + the experts' two all-reduces
    assert spec.expert_parallel_sizes() == [1, 2, 4, 8, 16] and spec_of().expert_parallel_sizes() == [1]
    dense = spec_of()
    assert dense.active_params == dense.total_params and dense.num_experts == 0


def test_moe_dense_first_layers_and_shared_experts():
    spec = spec_of("deepseek_v3", hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, intermediate_size=256,
                   kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                   head_dim=8, vocab_size=1024)
    assert (spec.num_experts, spec.experts_per_token, spec.moe_layers) == (8, 2, 2)  # layer 0 is dense
    assert spec.ffn == 32 + 2 * 32  # shared expert + top-2 routed


def test_moe_plan_never_ends_in_a_traceback(tmp_path, capsys):
    from transformers import AutoConfig

    from nd_parallel.cli.main import main

    AutoConfig.for_model("qwen3_moe", **QWEN3_MOE).save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--gpus-per-node", "8", "--gpu-memory", "1GiB", "--seq-len", "512",
                 "--global-batch", "8", "--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"]["experts"] == 16 and data["params"]["active"] < data["params"]["total"]
    assert data["plans"] and all(p["peak_memory_bytes"] <= GiB for p in data["plans"])


def test_expert_parallel_in_memory_time_and_search():
    """ep_size is searched (a divisor of dp_shard and of the experts); under ep the experts are whole on every tp rank
    (their states not divided by tp), FSDP gathers only the ep share, and the step pays the all-to-alls."""
    from dataclasses import replace

    from nd_parallel.planner.layout import Cluster, Layout, Training
    from nd_parallel.planner.memory import peak_memory, rank_params, unsharded_layer
    from nd_parallel.planner.search import Constraints, search
    from nd_parallel.planner.timing import all_to_all_bytes, step_time

    spec = spec_of("qwen3_moe", **QWEN3_MOE)
    train, cluster = Training(seq_len=512, global_batch=8), Cluster(1, 8, 8 * GiB)
    tp2 = Layout(dp_replicate=1, dp_shard=4, tp=2, cp=1, pp=1, micro_batch=2, microbatches=1)
    tp2_ep2 = replace(tp2, ep=2)
    experts = spec.layer_expert_params * spec.moe_layers
    assert rank_params(spec, tp2_ep2, 0)[0] - rank_params(spec, tp2, 0)[0] == experts / 2  # not split by tp
    assert unsharded_layer(spec, tp2_ep2) < unsharded_layer(spec, tp2) + spec.layer_expert_params / 2
    tokens = 2 * 512
    # tokens x top-k x hidden x 2 directions, forward and backward, the half that leaves the rank, every MoE layer
    assert all_to_all_bytes(spec, train, tp2_ep2, 4) == 4 * 4 * tokens * 4 * 256 * 2 / 2
    assert step_time(spec, train, tp2_ep2, cluster)["ep"] > 0 and "ep" not in step_time(spec, train, tp2, cluster)
    assert peak_memory(spec, train, tp2_ep2, cluster).peak > peak_memory(spec, train, tp2, cluster).peak
    result = search(spec, train, cluster)
    eps = {(r.layout.dp_shard, r.layout.ep) for r in result.plans}
    assert any(ep > 1 for _, ep in eps) and all(shard % ep == 0 and 16 % ep == 0 for shard, ep in eps)
    pinned = search(spec, train, cluster, Constraints(sizes={"ep": 4}))
    assert pinned.plans and all(p.layout.ep == 4 and p.layout.sizes()["ep_size"] == 4 for p in pinned.plans)
    dense = search(spec_of(), train, cluster)
    assert all(p.layout.ep == 1 and "ep_size" not in p.layout.sizes() for p in dense.plans)



@pytest.mark.parametrize("family, experts", [("qwen3_moe", "num_experts"), ("mixtral", "num_local_experts")])
def test_moe_layer_terms_match_what_a_measured_forward_saves(family, experts):
    """One process: what a MoE block (router + transformers' default grouped_mm experts) saves for backward, counted
    with autograd's saved-tensor hooks (parameters and the block's input, counted elsewhere, left out), equals the
    planner's MoE terms per token: the routed rows in and out (2 x top-k x h), the experts' 4 x top-k x width, the
    router's softmax and index vectors (measured 10344 bytes per token for Qwen3-MoE at h 128, width 256, 8 experts, top 2).
    The multi-rank rows (FSDP, EP, TP x EP) are in benchmarks/bench_planner_moe.py."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.planner.layout import Training
    from nd_parallel.planner.measure import saved_tensor_bytes
    from nd_parallel.planner.memory import routed_bytes_per_token, router_bytes_per_token

    shape = {"hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32, experts: 8, "num_experts_per_tok": 2, "intermediate_size": 256, "vocab_size": 256}
    if family == "qwen3_moe":
        shape["moe_intermediate_size"] = 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **shape))
    block = model.model.layers[0].mlp
    x = torch.randn(2, 256, 128, requires_grad=True)
    saved = saved_tensor_bytes(lambda: block(x), [*model.parameters(), x])
    spec, train = spec_of(family, **shape), Training(seq_len=256, global_batch=2, dtype="fp32")
    per_token = (routed_bytes_per_token(spec, train) + router_bytes_per_token(spec, train)
                 + train.compute_bytes * 4 * spec.expert_ffn)  # gate_up out (2 x width), act(gate), act x up
    assert spec.expert_ffn == 2 * 256 and per_token == 10344
    # Left out by the planner: the experts' offsets (num_experts int32 per layer, not per token) and Mixtral's
    # renormalised top-k weights (k + 1 fp32 per token): at most 16 bytes per token of 10344.
    assert abs(saved / 512 - per_token) <= 16, (saved / 512, per_token)


def test_ops_are_counted_for_a_model_without_sdpa(recwarn):
    """gpt-oss's attention sinks have no SDPA path: its ops are counted with eager attention, not left out."""
    spec = spec_of("gpt_oss", num_local_experts=8, num_experts_per_tok=2)
    assert not [w for w in recwarn if "cannot count" in str(w.message)]
    assert spec.ops.layer_fwd > 0 and spec.num_experts == 8
