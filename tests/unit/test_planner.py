"""Planner: units, the meta-device model spec, feasibility rules, the memory model on known cases, the search,
the CLI and `layout: auto`. Single process; the multi-rank validation is benchmarks/bench_planner.py."""

from __future__ import annotations

import json

import pytest
import torch

from nd_parallel.planner import (
    Cluster,
    Constraints,
    Layout,
    PlannerError,
    Training,
    UnitError,
    model_spec,
    parse_bandwidth,
    parse_bytes,
    parse_flops,
    peak_memory,
    scale_lr,
    search,
    to_json,
)
from nd_parallel.planner.memory import inflight, layer_activation_bytes, rank_memory
from nd_parallel.planner.meta import meta_model
from nd_parallel.testing.models import tiny_config

GiB = 2**30
BIG = Cluster(nodes=1, gpus_per_node=8, gpu_memory=10**15)


def spec_of(family="llama", **overrides):
    return model_spec(meta_model(tiny_config(family, **overrides)))


@pytest.fixture(scope="module")
def llama():
    return spec_of(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, vocab_size=4096, tie_word_embeddings=False)


# ------------------------------------------------------------------------------------------------- units
def test_units():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes(1024) == 1024
    assert parse_bandwidth("400GB/s") == 400e9 and parse_bandwidth("400Gb/s") == 50e9
    assert parse_bandwidth("400Gbps") == 50e9 and parse_flops("989TFLOPS") == 989e12


@pytest.mark.parametrize("text,func,needle", [("80XB", parse_bytes, "unknown unit 'XB'"),
                                              ("80Gb", parse_bytes, "in bits"),
                                              ("eighty", parse_bytes, "not a number"),
                                              ("400GB", parse_bandwidth, "per-second unit"),
                                              ("9 TOPS", parse_flops, "unknown unit")])
def test_unknown_units_name_the_value_and_the_valid_units(text, func, needle):
    with pytest.raises(UnitError, match=needle) as err:
        func(text)
    assert repr(text) in str(err.value)


# ------------------------------------------------------------------------------------------------- spec
def test_spec_counts_come_from_the_meta_model():
    for family in ("llama", "qwen3", "gemma"):
        config = tiny_config(family)
        spec = model_spec(meta_model(config))
        from transformers import AutoModelForCausalLM

        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        assert spec.total_params == total
        assert spec.tied == config.tie_word_embeddings
    assert spec_of("qwen3").qk_norm and not spec_of("llama").qk_norm
    llama = spec_of()
    assert llama.gated_mlp and llama.layer_tp_params == llama.layer_matmul_params  # norms are not TP-sharded
    assert len(llama.lora_linears) == 7  # q, k, v, o, gate, up, down


def test_model_without_a_layer_stack_is_refused():
    class NoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(PlannerError, match="cannot find the decoder-layer stack of NoLayers"):
        model_spec(NoLayers())


def test_missing_model_path(tmp_path):
    from nd_parallel.planner import spec_from_path

    with pytest.raises(PlannerError, match="does not exist"):
        spec_from_path(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlannerError, match="without config.json"):
        spec_from_path(str(tmp_path / "empty"))


# ------------------------------------------------------------------------------------------------- feasibility
def test_nine_heads_three_kv_heads_allow_tp_1_and_3_only():
    spec = spec_of(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    result = search(spec, Training(seq_len=512, global_batch=6), Cluster(nodes=1, gpus_per_node=6, gpu_memory=80 * GiB))
    assert {p.layout.tp for p in result.plans} == {1, 3}
    reasons = [r for sizes, r in result.rejected if sizes["tp_size"] in (2, 6)]
    assert reasons and all("tp must be in [1, 3, 9]" in r for r in reasons)


def test_rules_for_cp_pp_topology_and_batch(llama):
    result = search(llama, Training(seq_len=4, global_batch=16), Cluster(nodes=2, gpus_per_node=4,
                                                                        gpu_memory=80 * GiB))
    by_sizes = {tuple(s.values()): r for s, r in result.rejected}
    assert "2*cp = 8 chunks" in by_sizes[(1, 1, 1, 4, 2)]  # rep, shard, tp, cp, pp
    assert "exceed one node" in by_sizes[(1, 1, 4, 2, 1)]
    assert "pp_size=8 stages but the model has 4 layers" in by_sizes[(1, 1, 1, 1, 8)]
    odd = search(llama, Training(seq_len=64, global_batch=3), Cluster(nodes=1, gpus_per_node=2, gpu_memory=GiB))
    assert any("global batch 3 does not split over dp = 2" in r for _, r in odd.rejected)
    with pytest.raises(PlannerError, match="cp_backend='ulysses' needs heads/tp=8 and kv_heads/tp=4 divisible by cp"):
        search(llama, Training(seq_len=64, global_batch=8), Cluster(nodes=1, gpus_per_node=8, gpu_memory=80 * GiB),
               Constraints(cp_backend="ulysses", sizes={"cp": 8}))


def test_contradictory_constraints_are_one_clear_error(llama):
    train = Training(seq_len=64, global_batch=8)
    with pytest.raises(PlannerError, match="pinned sizes tp=3 = 3 ranks do not divide the 8 GPUs"):
        search(llama, train, BIG, Constraints(sizes={"tp": 3}))
    with pytest.raises(PlannerError, match="pp is pinned to 1"):
        search(llama, train, BIG, Constraints(sizes={"pp": 1}, schedule="gpipe"))
    with pytest.raises(PlannerError, match="no layout of 8 GPUs is legal"):
        search(llama, train, BIG, Constraints(sizes={"tp": 8}))  # 4 kv heads


# ------------------------------------------------------------------------------------------------- memory model
def test_single_process_fp32_known_case(llama):
    """The component formulas, written out by hand for one shape (b=2, s=512, fp32, AdamW, no sharding)."""
    train = Training(seq_len=512, global_batch=2, dtype="fp32", loss_chunk=0)  # HF's loss on the full logits
    mem = peak_memory(llama, train, Layout(1, 1, 1, 1, 1, micro_batch=2), BIG)
    tokens, h, f, q, kv, V = 1024, 256, 688, 256, 128, 4096
    per_layer = 2 * (12 * h + 4) + 4 * (q + 2 * kv + q) + 4 * 8 + 4 * 4 * f  # norms, q k v out, lse, gated MLP
    assert mem.phase == "backward start"
    assert mem.parts["params"] == 4 * llama.total_params and mem.parts["grads"] == 0
    assert mem.parts["optimizer"] == 8 * llama.total_params
    assert mem.parts["activations"] == tokens * (4 * per_layer + 12 * h + 4)  # + the final norm
    assert mem.parts["logits"] == 16 * tokens * V  # logits, log_softmax out, both gradients (fp32)
    # The chunked loss's linear fast path: a chunk buffer, the hidden states' and the head's gradients (test_linear_loss)
    chunked = peak_memory(llama, Training(seq_len=512, global_batch=2, dtype="fp32", loss_chunk=128),
                          Layout(1, 1, 1, 1, 1, micro_batch=2), BIG).moments["backward start"]  # not its peak
    assert llama.linear_head and chunked["logits"] == 4 * 128 * V + 4 * tokens * h + 4 * V * h


@pytest.mark.parametrize("chunk", [0, 128])
def test_single_process_prediction_matches_a_measured_step(llama, chunk):
    """The same case measured: one AdamW step's peak live tensor bytes within 2%, HF's loss (0) and chunked."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.chunked_loss import ChunkedLoss
    from nd_parallel.planner.measure import LiveTensorBytes, state_tensors

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=32, vocab_size=4096, tie_word_embeddings=False,
                         max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if chunk:
        ChunkedLoss(model, chunk)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1, 4096, (2, 256))

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    with LiveTensorBytes(state_tensors(model, opt)) as tracker:
        step()
    predicted = peak_memory(llama, Training(seq_len=256, global_batch=2, dtype="fp32", loss_chunk=chunk),
                            Layout(1, 1, 1, 1, 1, micro_batch=2), Cluster(1, 1, 10**12, device="cpu")).peak
    assert abs(predicted / tracker.peak - 1) < 0.02, (predicted, tracker.peak)


def test_sharding_factors(llama):
    train = Training(seq_len=256, global_batch=8, dtype="bf16")
    one = peak_memory(llama, train, Layout(1, 1, 1, 1, 1, micro_batch=8), BIG).parts
    fsdp = peak_memory(llama, train, Layout(1, 8, 1, 1, 1, micro_batch=1), BIG).parts
    hsdp = peak_memory(llama, train, Layout(2, 4, 1, 1, 1, micro_batch=1), BIG).parts
    assert fsdp["optimizer"] == one["optimizer"] // 8 and hsdp["optimizer"] == one["optimizer"] // 4
    cp = peak_memory(llama, train, Layout(1, 1, 1, 8, 1, micro_batch=8), BIG).parts
    assert cp["activations"] == one["activations"] // 8 and cp["optimizer"] == one["optimizer"] // 8  # FSDP over cp


def test_lora_base_has_no_grads_or_optimizer_state(llama):
    full = Training(seq_len=256, global_batch=1, dtype="bf16")
    lora = Training(seq_len=256, global_batch=1, dtype="bf16", lora_rank=8)
    lay = Layout(1, 1, 1, 1, 1, microbatches=1)
    a, b = peak_memory(llama, full, lay, BIG).parts, peak_memory(llama, lora, lay, BIG).parts
    assert b["params"] == a["params"]
    assert b["optimizer"] == 8 * llama.num_layers * llama.lora_layer_params(8)
    assert llama.lora_layer_params(8) == 8 * sum(i + o for i, o in llama.lora_linears)


def test_checkpointing_orders_memory(llama):
    train = Training(seq_len=1024, global_batch=4, dtype="bf16")
    saved = {m: layer_activation_bytes(llama, train, 1, m)[0] for m in ("none", "selective", "full")}
    assert saved["none"] > saved["selective"] > saved["full"] == 2 * llama.hidden
    assert layer_activation_bytes(llama, train, 1, "full")[1] == saved["none"]  # one layer recomputed at a time


def test_tp_splits_attention_and_mlp_not_the_norms(llama):  # without SP; with it: tests/unit/test_sequence_parallel.py
    train = Training(seq_len=1024, global_batch=4, dtype="fp32", sequence_parallel=False)
    one, two = (layer_activation_bytes(llama, train, tp, "none")[0] for tp in (1, 2))
    norms = 2 * (12 * llama.hidden + 4)
    assert two - norms == pytest.approx((one - norms) / 2)


def test_pipeline_in_flight_micro_batches():
    one_f_one_b = Layout(1, 1, 1, 1, 4, microbatches=8, schedule="1f1b")
    assert [inflight(one_f_one_b, r) for r in range(4)] == [4, 3, 2, 1]
    assert inflight(Layout(1, 1, 1, 1, 4, microbatches=8, schedule="gpipe"), 0) == 8
    inter = Layout(1, 1, 1, 1, 4, microbatches=8, schedule="interleaved-1f1b", virtual=2)
    assert inflight(inter, 0) == pytest.approx(4 + 3 / 2)  # Megatron: p * (1 + (p-1)/(p*v))


def test_pipeline_stage_zero_is_the_busiest_and_keeps_grads(llama):
    train = Training(seq_len=256, global_batch=8, dtype="bf16")
    lay = Layout(1, 1, 1, 1, 2, micro_batch=1, microbatches=8, schedule="1f1b")
    first, last = (rank_memory(llama, train, lay, BIG, r) for r in (0, 1))
    assert first.parts["activations"] > last.parts["activations"] and last.parts["logits"] > 0 == first.parts["logits"]
    assert first.parts["grads"] > 0  # backward of earlier micro-batches ran before the peak


# ------------------------------------------------------------------------------------------------- time
def test_op_counts_come_from_the_model(llama):
    """Per-layer op counts are run on the meta model, not tabled: one Llama layer is q k v o gate up down (5 colwise,
    2 rowwise), 9 parameter tensors; LoRA's wrappers add ops; the ring's own-shard step plans three blocks."""
    from nd_parallel.planner.ops import _module_ops

    ops = llama.ops
    assert (llama.layer_colwise, llama.layer_rowwise, llama.layer_tensors, llama.rest_tensors) == (5, 2, 9, 3)
    assert ops.layer_fwd > 0 and ops.layer_bwd > ops.layer_fwd  # backward dispatches more than forward
    assert ops.lora_layer_fwd > ops.layer_fwd and ops.lora_layer_bwd > ops.layer_bwd
    assert ops.tp_layer == 7 * _module_ops(torch.nn.Linear(4, 4, bias=False, device="meta"))
    assert ops.ring_diagonal > ops.ring_off_diagonal > 0
    assert ops.adam_tensor == 8  # lerp/mul/addcmul on the moments, sqrt/div/add, the decay and the update
    qwen = spec_of("qwen3")
    assert qwen.ops.layer_fwd > spec_of("llama").ops.layer_fwd  # q/k norms run ops of their own


def _overhead_only(**kw):
    """A cluster where only the term under test costs anything."""
    base = dict(intra_bw=1e30, inter_bw=1e30, flops=1e30, efficiency=1.0, mem_bw=1e30, latency=0.0, op_overhead=0.0,
                dtensor_op_overhead=0.0, device="cpu")
    return Cluster(1, 4, 10**15, **{**base, **kw})


def test_dispatch_terms_on_known_cases(llama):
    from nd_parallel.planner import step_time

    ops, L, train = llama.ops, 4, Training(seq_len=64, global_batch=4, dtype="fp32")
    plain = _overhead_only(op_overhead=1.0)
    single = step_time(llama, train, Layout(1, 1, 1, 1, 1, micro_batch=4), plain)
    assert single["dispatch"] == L * (ops.layer_fwd + ops.layer_bwd) + ops.rest_fwd + ops.rest_bwd
    tensors = L * 9 + 3  # plain parameters: every AdamW op at op_overhead
    assert single["optimizer"] == pytest.approx(tensors * (ops.adam_tensor + ops.adam_scalar))
    ckpt = step_time(llama, train, Layout(1, 1, 1, 1, 1, micro_batch=4, checkpointing="full"), plain)
    assert ckpt["dispatch"] - single["dispatch"] == L * ops.layer_fwd  # the forward runs again
    cp = step_time(llama, train, Layout(1, 1, 1, 4, 1, micro_batch=4), plain)
    assert cp["dispatch"] - single["dispatch"] == L * (ops.ring_diagonal + 3 * ops.ring_off_diagonal)
    dtensor = _overhead_only(dtensor_op_overhead=1.0)
    tp = step_time(llama, train, Layout(1, 2, 2, 1, 1, micro_batch=2), dtensor)
    assert tp["dispatch"] == L * ops.tp_layer + ops.tp_rest  # the sharded Linears, embedding and head
    assert tp["optimizer"] == tensors * ops.adam_tensor  # FSDP x TP parameters are DTensors
    lora = step_time(llama, Training(seq_len=64, global_batch=4, dtype="fp32", lora_rank=8),
                     Layout(1, 1, 1, 1, 1, micro_batch=4), plain)
    assert lora["optimizer"] == pytest.approx(L * 2 * 7 * (ops.adam_tensor + ops.adam_scalar))  # A and B only


def test_collective_counts_on_known_cases(llama):
    """With one second per collective: TP all-reduces per rowwise module forward and per colwise module backward,
    plus the vocabulary-parallel embedding, the head's input gradient and loss_parallel's three: 4 x 7 + 5 = 33,
    the 33 all-reduces a real fsdp2 x tp2 step of this model dispatches (one loss chunk). The CP ring's 3cp-2
    send/recv pairs per layer; the pipeline's hops."""
    from nd_parallel.planner import step_time

    train, slow = Training(seq_len=64, global_batch=4, dtype="fp32"), _overhead_only(latency=1.0, p2p_latency=1.0)
    assert step_time(llama, train, Layout(1, 2, 2, 1, 1, micro_batch=2), slow)["tp"] == pytest.approx(33)
    assert step_time(llama, train, Layout(1, 1, 1, 4, 1, micro_batch=4), slow)["cp"] == pytest.approx(4 * 10)
    pp = step_time(llama, train, Layout(1, 1, 1, 1, 4, micro_batch=1, microbatches=4, schedule="1f1b"), slow)
    assert pp["pp"] == pytest.approx(2 * (4 + 3))


def test_bubble_is_the_other_stages_fill_and_drain(llama):
    """The last stage carries the head and loss: the bubble is one micro-batch of each other stage, not p-1 of the
    slowest; ranks that share cores run it idle_speedup times faster."""
    from nd_parallel.planner import step_time
    from nd_parallel.planner.timing import _rank_mb_seconds

    train = Training(seq_len=64, global_batch=4, dtype="fp32")
    lay = Layout(1, 1, 1, 1, 4, micro_batch=1, microbatches=4, schedule="1f1b")
    cpu = Cluster(1, 4, 10**15, flops=1e9, efficiency=1.0, device="cpu", op_overhead=0.0, dtensor_op_overhead=0.0)
    per_rank = [_rank_mb_seconds(llama, train, lay, cpu, r) for r in range(4)]
    assert per_rank[3] == max(per_rank) > per_rank[0]
    assert step_time(llama, train, lay, cpu)["bubble"] == pytest.approx(sum(per_rank[:3]))
    shared = Cluster(1, 4, 10**15, flops=1e9, efficiency=1.0, device="cpu", op_overhead=0.0,
                     dtensor_op_overhead=0.0, idle_speedup=2.0)
    assert step_time(llama, train, lay, shared)["bubble"] == pytest.approx(sum(per_rank[:3]) / 2)


# ------------------------------------------------------------------------------------------------- search
def test_json_has_the_contract_shape(llama):
    result = search(llama, Training(seq_len=256, global_batch=8), BIG)
    data = json.loads(json.dumps(to_json(result, top=3)))
    assert set(data) >= {"plans", "rejected", "hint"} and len(data["plans"]) == 3
    plan = data["plans"][0]
    for key in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size", "peak_memory_bytes",
                "step_time_s"):
        assert key in plan
    assert set(plan["memory"]) >= {"params", "grads", "optimizer", "activations"}
    assert plan["peak_memory_bytes"] == sum(plan["memory"].values())
    times = [p["step_time_s"] for p in data["plans"]]
    assert times == sorted(times)
    assert all(set(r) == {"layout", "reason"} for r in data["rejected"])


def test_nothing_fits_gives_the_smallest_memory_and_the_knob(llama):
    result = search(llama, Training(seq_len=1024, global_batch=8), Cluster(nodes=1, gpus_per_node=2,
                                                                           gpu_memory=2**20))
    assert result.plans == []
    assert "nothing fits in 1 MiB" in result.hint and "needs" in result.hint and "knob that helps most" in result.hint


def test_search_of_a_large_model_runs_in_seconds():
    import time

    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    start = time.perf_counter()
    spec = model_spec(meta_model(config))
    result = search(spec, Training(seq_len=8192, global_batch=256), Cluster(nodes=8, gpus_per_node=8,
                                                                          gpu_memory=80 * GiB))
    assert result.plans and time.perf_counter() - start < 30
    assert 7.9e9 < spec.total_params < 8.1e9


def test_lr_scaling():
    assert scale_lr(1e-4, 256, 64, "linear") == pytest.approx(4e-4)
    assert scale_lr(1e-4, 256, 64, "sqrt") == pytest.approx(2e-4)
    with pytest.raises(PlannerError, match="'linear' or 'sqrt'"):
        scale_lr(1e-4, 256, 64, "cubic")


# ------------------------------------------------------------------------------------------------- entry points
def test_cli_json_and_errors(tmp_path, capsys):
    from nd_parallel.cli.main import main

    path = tmp_path / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    assert main(["plan", str(path), "--gpus-per-node", "4", "--seq-len", "64", "--global-batch", "8", "--json",
                 "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 2 and data["plans"][0]["peak_memory_bytes"] > 0
    assert main(["plan", str(path), "--seq-len", "64", "--global-batch", "8", "--gpu-memory", "80 gigs"]) == 2
    assert "unknown unit 'gigs'" in capsys.readouterr().err
    assert main(["plan", str(path), "--seq-len", "64", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "# Axolotl" in out and "tensor_parallel_size" in out and "parallelism_config_tp_size" in out


def test_parallelism_config_auto(tmp_path):
    from nd_parallel.config import ConfigError, ParallelismConfig

    path = tmp_path / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    config = ParallelismConfig.auto(str(path), seq_len=64, global_batch=8, world_size=4, gpu_memory="1GiB",
                                    device="cpu")
    assert config.world_size == 4 and config.plan.memory.peak <= 2**30
    with pytest.raises(ConfigError, match="nothing fits"):
        ParallelismConfig.auto(str(path), seq_len=64, global_batch=8, world_size=4, gpu_memory="1KiB", device="cpu")


def test_train_yaml_layout_auto(tmp_path):
    from nd_parallel.cli.plan import auto_train_layout, scaled_learning_rate
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.config import ConfigError
    from nd_parallel.testing.models import save_tiny_model

    model = save_tiny_model("llama", tmp_path / "model")
    (tmp_path / "d.txt").write_text("hello\n")
    base = f"base_model: {model}\ndataset_path: {tmp_path / 'd.txt'}\nsequence_len: 64\nmicro_batch_size: 2\n"
    (tmp_path / "a.yaml").write_text(base + "layout: auto\nlr_scaling: sqrt\nbase_batch_size: 2\n")
    cfg = load_train_config(tmp_path / "a.yaml")
    config, global_batch = auto_train_layout(cfg, "a.yaml", 4, "cpu")
    assert config.world_size == 4 and global_batch == 8
    assert cfg.micro_batch_size * cfg.gradient_accumulation_steps * config.dp_size == 8
    assert scaled_learning_rate(cfg, "a.yaml", 8) == pytest.approx(2 * cfg.learning_rate)
    (tmp_path / "b.yaml").write_text(base + "layout: auto\ntp_size: 2\n")
    with pytest.raises(ConfigError, match="layout: auto chooses the layout, but the file also sets tp_size"):
        load_train_config(tmp_path / "b.yaml")
