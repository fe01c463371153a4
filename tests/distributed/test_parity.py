"""The parity matrix: every layout trains exactly like one process on the same global batches.

One torchrun launch per world size runs every (family, layout) of that size; each pair is then its own
test case comparing loss per step (rtol 1e-5), the global gradient norm per step (rtol 1e-5) and every
parameter after the last step (atol 1e-5) with a single-process reference. The data has right padding, so
data-parallel ranks hold different numbers of label tokens in every step.
"""

import json

import pytest
import torch

from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, RunResult, compare, train_reference

WORKER = "tests/distributed/parity_worker.py"
SAMPLES = dict(n=96, seq_len=24)  # enough for 5 steps of the largest global batch (4 dp x 4)
LOSS_RTOL = NORM_RTOL = 1e-5
PARAM_ATOL = 1e-5


# The loss is chunked by default (loss_chunk_size="auto", at least 128 tokens: one chunk of these short batches).
# Rows marked C run 8-token chunks, so a rank's tokens span several chunks (and a cp shard cuts them); rows marked
# OFF compute HF's unchunked loss, so both paths stay covered in each layout family.
C = dict(loss_chunk_size=8)
OFF = dict(loss_chunk_size=0)


def L(n_layers=2, samples=None, **config):
    """A layout: ParallelismConfig kwargs, the depth of the tiny model it trains, and its data if not SAMPLES."""
    return {"config": config, "layers": n_layers, "samples": samples or SAMPLES}


# Data that stresses context parallelism: a length that 2*cp does not divide (the sequence is padded), packed
# documents (position ids restart, no attention_mask), and left padding (queries that see no key at all).
ODD = dict(n=96, seq_len=23)
PACKED = dict(n=96, seq_len=24, packed=True)
LEFT_PADDED = dict(n=96, seq_len=24, left_pad=True)
# The text runs out at sample 18: in the last step rank 1's two samples are padding only, no label token (the tail of
# a dataset). Its head still needs a (zero) gradient, or FSDP's root reduce-scatter differs in size between ranks.
TAIL = dict(n=20, seq_len=336)


# launch name -> (world size, samples per dp rank per step, {layout name: layout})
LAUNCHES = {
    "2r": (2, 2, {
        "ddp2": L(dp_replicate_size=2),
        "fsdp2": L(dp_shard_size=2, **C),
        "fsdp2_unlabelled": L(dp_shard_size=2, loss_chunk_size=64, samples=TAIL),
        "tp2": L(tp_size=2, **C),
        "fsdp2_compile": L(dp_shard_size=2, compile=True, compile_backend="aot_eager"),
        # the embedding's all-reduce hands layer 0 an AsyncCollectiveTensor (distributed/compile.py: waited for)
        "tp2_compile": L(tp_size=2, compile=True, compile_backend="aot_eager"),
        # activation offloading wraps the compiled layer, the tiled MLP's checkpointed tiles trace into it
        "fsdp2_compile_offload_tiled": L(dp_shard_size=2, compile=True, compile_backend="aot_eager",
                                         activation_offloading=True, tiled_mlp=True, tiled_mlp_num_shards=2),
    }),
    "4r": (4, 2, {
        "hsdp2x2": L(dp_replicate_size=2, dp_shard_size=2, **OFF),
        "fsdp2_tp2": L(dp_shard_size=-1, tp_size=2, **C),
        "ddp2_tp2": L(dp_replicate_size=2, tp_size=2, sequence_parallel=False, **OFF),  # plain TP stays covered
        "fsdp2_tp2_compile": L(dp_shard_size=-1, tp_size=2, compile=True, compile_backend="aot_eager"),
    }),
    "8r": (8, 4, {
        "hsdp2x2_tp2": L(dp_replicate_size=2, dp_shard_size=2, tp_size=2),
        "pp2_fsdp2_tp2": L(4, pp_size=2, dp_shard_size=2, tp_size=2),  # 3-D: pp x dp x tp
    }),
    "pp2r": (2, 4, {
        "pp2_gpipe": L(4, pp_size=2, pp_schedule="gpipe", **OFF),
        "pp2_1f1b": L(4, pp_size=2, pp_schedule="1f1b", pp_microbatches=4, **C),
        "pp2_interleaved": L(4, pp_size=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2),
        "pp2_interleaved_zb": L(4, pp_size=2, pp_schedule="interleaved-zb", pp_virtual_stages=2, **C),
        "pp2_zbv": L(4, pp_size=2, pp_schedule="zbv", pp_virtual_stages=2, **C),
        "pp2_uneven_5l": L(5, pp_size=2),  # default split: 3 + 2 layers
        "pp2_packed": L(4, pp_size=2, samples=PACKED),  # stages reproduce transformers' (non-)isolation
        "pp2_compile": L(4, pp_size=2, compile=True, compile_backend="aot_eager"),
    }),
    "pp4r": (4, 4, {
        "pp4_1f1b": L(4, pp_size=4, pp_microbatches=4),
        "pp2_fsdp2": L(4, pp_size=2, dp_shard_size=2),
        "pp2_tp2": L(4, pp_size=2, tp_size=2),
    }),
    # More families, each with its own twist: fused qkv (phi3, gpt_neox), biases (phi, starcoder2),
    # soft-capping + eager attention (gemma2), sliding windows (gemma3_text), post-norms (olmo2), no tp_plan
    # and learned positions (gpt2).
    # Context parallelism: ring (load-balanced and contiguous shards) and Ulysses, alone and composed.
    "cp2r": (2, 2, {
        "cp2": L(cp_size=2, **C),
        "cp2_contiguous": L(cp_size=2, cp_load_balance=False, **OFF),
        "ulysses2": L(cp_size=2, cp_backend="ulysses", **C),
        "cp2_odd_len": L(cp_size=2, samples=ODD),
        "cp2_packed": L(cp_size=2, samples=PACKED),
        "ulysses2_packed": L(cp_size=2, cp_backend="ulysses", samples=PACKED),
        "cp2_left_padded": L(cp_size=2, samples=LEFT_PADDED),
        "cp2_compile": L(cp_size=2, compile=True, compile_backend="aot_eager"),  # the ring stays out of the graph
    }),
    "cp4r": (4, 2, {
        "cp4": L(cp_size=4),
        "cp4_odd_len": L(cp_size=4, samples=ODD),
        "cp2_fsdp2": L(cp_size=2, dp_shard_size=2),
        "cp2_tp2": L(cp_size=2, tp_size=2),
        "cp2_pp2": L(4, cp_size=2, pp_size=2),
        "ulysses2_fsdp2": L(cp_size=2, dp_shard_size=2, cp_backend="ulysses"),
    }),
    # Twists of other families under CP: soft-capping (gemma2), sliding windows shorter than the sequence
    # (gemma3_text, window 8: the window crosses shard boundaries), learned positions (gpt2), fused qkv (phi3),
    # attention sinks in a MoE (gpt_oss).
    "cp_families": (2, 2, {
        "cp2_odd_len": L(cp_size=2, samples=ODD),
        "ulysses2": L(cp_size=2, cp_backend="ulysses"),
        "cp2_packed": L(cp_size=2, samples=PACKED),
    }),
    # Expert parallelism (ep borrows ranks from dp_shard): alone (one expert per rank), with the experts
    # FSDP-sharded over the dp ranks left, and under HSDP. One launch, to stay within the suite's time: every MoE
    # family runs ep4, the three main ones the compositions (EP2 alone on 2 ranks would add a launch and no path
    # that ep4 does not take).
    "ep4r": (4, 2, {
        "ep4": L(dp_shard_size=4, ep_size=4),
        "ep2_fsdp2": L(dp_shard_size=4, ep_size=2),
        "ep2_hsdp2x2": L(dp_replicate_size=2, dp_shard_size=2, ep_size=2),
        # recomputation repeats the layer's two all-to-alls in backward, in the same order on every rank
        "ep2_fsdp2_ac": L(dp_shard_size=4, ep_size=2, activation_checkpointing="full"),
        # each pipeline stage splits the experts of its own layers; the ep group shares the stage and the schedule
        "pp2_ep2": L(4, pp_size=2, dp_shard_size=2, ep_size=2),
        # sequence shards route like any tokens; the experts are FSDP-sharded over the cp ranks too
        "cp2_ep2": L(cp_size=2, dp_shard_size=2, ep_size=2),
        # TP on attention, dense MLPs and shared experts, the experts split over ep and whole on each tp rank
        "tp2_ep2": L(tp_size=2, dp_shard_size=2, ep_size=2),
    }),
    "families": (2, 4, {
        "fsdp2": L(4, dp_shard_size=2),
        "tp2": L(4, tp_size=2),
        "pp2": L(4, pp_size=2),
    }),
}
EXCLUDE = {("gpt2", "tp2")}  # gpt2 has no tp_plan: refused, see tests/unit/test_plugin_errors.py
# Decoder layers that return tuples (falcon; bloom, with ALiBi from the mask) or modules registered out of run order
# (OPT's final norm before its layers, learned positions): their row is PP2. None has a tp_plan, and FSDP2 changes
# nothing these families do differently from the others, so those rows would only cost time.
EXCLUDE |= {(f, n) for f in ("falcon", "bloom", "opt") for n in ("fsdp2", "tp2")}
EXCLUDE |= {(f, n) for f in ("deepseek_v3_ep", "gpt_oss") for n in ("ep2_fsdp2", "ep2_hsdp2x2")}
EXCLUDE |= {("qwen3_moe_ep", "ep2_hsdp2x2"), ("mixtral_aux", "ep4")}
EXCLUDE |= {(f, n) for f in ("qwen3_moe_ep", "olmoe_ep", "deepseek_v3_ep", "gpt_oss", "mixtral_aux")
            for n in ("ep2_fsdp2_ac", "pp2_ep2", "cp2_ep2")}
# TP2 x EP2 on three MoE families: plain (mixtral), per-head q/k norms under TP (qwen3_moe), shared
# experts under TP next to the experts under EP (deepseek_v3).
EXCLUDE |= {(f, "tp2_ep2") for f in ("olmoe_ep", "gpt_oss", "mixtral_aux")}
# llama: tied embeddings; qwen3: per-head q/k norms (replicated_with_grad_allreduce); mistral: untied;
# gemma: tied, scaled embeddings and a padding_idx inside the vocab-sharded embedding.
# Mixture-of-experts and MLA families under their own tp_plans, in the 2- and 4-rank launches (no launch of their
# own: start-up is most of a launch's time): TP2 and FSDP2 x TP2 only, FSDP alone splits them as any model.
MOE_TP = ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2", "gpt_oss", "qwen2_moe"]
EXCLUDE |= {(f, n) for f in MOE_TP for n in ("ddp2", "fsdp2", "hsdp2x2", "ddp2_tp2", "pp4_1f1b", "pp2_fsdp2")}
# llama4: packed_rowwise experts ([E, H, 2I]) read by the memory-efficient loader, and the shared expert's output that
# its MoE block adds to in place (cloned under TP): TP2 only.
EXCLUDE |= {("llama4_text", n) for n in ("ddp2", "fsdp2")}
FAMILIES = {"2r": ["llama", "qwen3", "mistral", "gemma", *MOE_TP, "llama4_text"], "4r": ["llama", "qwen3", "mistral", "gemma",
                                                                         "deepseek_v2"],
            "8r": ["llama", "qwen3", "mistral"], "pp2r": ["llama", "qwen3", "mistral"],
            "pp4r": ["llama", "qwen3", "mistral", "deepseek_v2"],  # deepseek_v2: PP2 x TP2 only
            "families": ["phi3", "gpt_neox", "phi", "starcoder2", "gemma2", "gemma3_text", "olmo2", "gpt2",
                         "falcon", "bloom", "opt"],
            "ep4r": ["mixtral_ep", "qwen3_moe_ep", "olmoe_ep", "deepseek_v3_ep", "gpt_oss", "mixtral_aux"],
            "cp2r": ["llama", "qwen3", "mistral"], "cp4r": ["llama", "qwen3", "mistral"],
            "cp_families": ["gemma2", "gemma3_sw8", "gpt2", "phi3", "llama_nocache", "gpt_oss"]}
# compile=True (aot_eager: dynamo + AOTAutograd, bit-equal to eager; inductor is tests/unit/test_compile.py): llama
# only, since compiling costs seconds per rank and the other families add nothing compile-specific.
EXCLUDE |= {(f, n) for fams in FAMILIES.values() for f in fams if f != "llama"
            for n in ("fsdp2_compile", "pp2_compile", "cp2_compile", "tp2_compile", "fsdp2_tp2_compile",
                      "fsdp2_compile_offload_tiled")}
# An untied head (a tied one gets its gradient through the embedding anyway): qwen3 only.
EXCLUDE |= {(f, "fsdp2_unlabelled") for f in FAMILIES["2r"] if f != "qwen3"}
# Tiny MoE configs: 4 experts, top 2, expert width 32 (tp=2 splits each packed half evenly). deepseek: MLA (q/kv LoRA
# ranks, rope part 8), one shared expert, a dense first layer, one routing group; qwen3_moe: a dense first layer too.
_DEEPSEEK = dict(n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                 topk_group=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                 num_key_value_heads=4, intermediate_size=64, tie_word_embeddings=False, num_experts_per_tok=2)
MOE_VARIANTS = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=None)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    mlp_only_layers=[0], intermediate_size=64, tie_word_embeddings=False)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False)),
    "deepseek_v3": ("deepseek_v3", dict(_DEEPSEEK, q_lora_rank=32)),  # its plan leaves MLA attention replicated
    "deepseek_v2": ("deepseek_v2", dict(_DEEPSEEK, q_lora_rank=None)),  # its plan splits MLA heads: mla_kv_a_proj
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, tie_word_embeddings=False)),
}
# Family names that are a family with config overrides. use_cache=False: transformers then masks packed
# documents apart (with the default use_cache=True it does not; both are reproduced, see
# context_parallel/sharding.isolates_documents).
VARIANTS = {"gemma3_sw8": ("gemma3_text", dict(sliding_window=8)), "llama_nocache": ("llama", dict(use_cache=False)),
            # Attention sinks (s_aux) on every layer, a window of 8 on every other one; a small MoE (4 experts, top 2).
            "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
            "opt": ("opt", dict(dropout=0.0)),
            # MoE families with 4 experts (ep 4 holds one per rank), top 2; every layer sparse (deepseek_v3's default
            # first dense layers would leave nothing to split); deepseek_v3's group routing over one group, and its
            # MLA attention (every head its own kv head) at tiny sizes.
            "mixtral_ep": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
            # The router's load-balancing loss, weighted enough that a per-rank value (about dp times one process's)
            # would fail the loss check by far.
            "mixtral_aux": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                            router_aux_loss_coef=0.05)),
            "qwen3_moe_ep": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
            "olmoe_ep": ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
            "deepseek_v3_ep": ("deepseek_v3", dict(
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
                moe_intermediate_size=32, num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, kv_lora_rank=32, q_lora_rank=32, head_dim=8)),
            **MOE_VARIANTS}  # OPT's default dropout 0.1 would differ per process
# Sequence parallelism is on by default under TP where exact ("auto"): every tp row of a dense family below runs it
# (tp2, fsdp2_tp2, hsdp2x2_tp2, pp2_tp2, pp2_fsdp2_tp2, cp2_tp2, and the families launch: sandwich norms, parallel
# residuals, LayerNorm with bias), which each row asserts; these plans keep it off (styles SP does not cover).
# "auto" keeps sequence parallelism off where a layer holds a MoE block (its experts sit outside the TP regions, EP
# included) or a gather-output / split-input style (olmo2, phi3): sequence_parallel.reason_not_exact
NO_SP = {*MOE_TP, "llama4_text", *FAMILIES["ep4r"], "olmo2", "phi3"}


def sp_expected(family: str, config: dict) -> bool:
    return config.get("tp_size", 1) > 1 and config.get("sequence_parallel", "auto") is not False \
        and family not in NO_SP


CASES = [(launch, f, name) for launch, (_, _, layouts) in LAUNCHES.items() for f in FAMILIES[launch] for name in layouts
         if (f, name) not in EXCLUDE]


def _dp(config: dict, world: int) -> int:
    others = config.get("tp_size", 1) * config.get("pp_size", 1) * config.get("cp_size", 1)
    replicate = config.get("dp_replicate_size", 1)
    shard = config.get("dp_shard_size", 1)
    if shard == -1:
        shard = world // (others * replicate)
    return replicate * shard


def _model(tiny_model, family, layers):
    base, overrides = VARIANTS.get(family, (family, {}))
    return tiny_model(base, num_hidden_layers=layers, **overrides)


def _spec(name, tiny_model):
    _, per_rank, layouts = LAUNCHES[name]
    return {
        "models": {f"{f}{lay['layers']}": _model(tiny_model, f, lay["layers"])
                   for f in FAMILIES[name] for lay in layouts.values()},
        "runs": [[f"{f}{lay['layers']}", n, lay["config"], f"{f}__{n}", lay["samples"]]
                 for f in FAMILIES[name] for n, lay in layouts.items() if (f, n) not in EXCLUDE],
        "recipe": dict(steps=5, per_rank_batch=per_rank, lr=1e-3),
    }


@pytest.fixture(scope="module")
def runs(tiny_model, launch_worker):
    """launch name -> directory of rank-0 results, launched lazily once per launch."""
    return lambda name: launch_worker(f"parity_{name}", WORKER, LAUNCHES[name][0], lambda _: _spec(name, tiny_model))


@pytest.fixture(scope="module")
def references(tiny_model, memo):
    """The single-process run a layout must reproduce: its model, data-parallel size, batch and data."""
    def get(family, layers, dp, per_rank, samples):
        recipe = Recipe(steps=5, per_rank_batch=per_rank, lr=1e-3)
        return memo((family, layers, dp, per_rank, json.dumps(samples, sort_keys=True)), lambda: train_reference(
            _model(tiny_model, family, layers), make_samples(**samples), dp, recipe))

    return get


@pytest.mark.parametrize("launch_name,family,layout", CASES, ids=[f"{a}-{f}-{n}" for a, f, n in CASES])
def test_layout_matches_single_process(launch_name, family, layout, runs, references):
    world, per_rank, layouts = LAUNCHES[launch_name]
    saved = torch.load(runs(launch_name) / f"{family}__{layout}.pt", weights_only=True)
    run = RunResult(saved["losses"], saved["norms"], saved["state"])
    lay = layouts[layout]
    ref = references(family, lay["layers"], _dp(lay["config"], world), per_rank, lay["samples"])
    diff = compare(ref, run)
    print(f"{launch_name} {family} {layout}: {diff}")
    assert len(ref.losses) == 5, "the data ran out before the last step"
    assert saved["rank_spread"] == 0.0, "the reported loss differs between ranks"
    assert saved["sequence_parallel"] == sp_expected(family, lay["config"])
    assert diff["loss_rel"] <= LOSS_RTOL, (diff, run.losses, ref.losses)
    assert diff["norm_rel"] <= NORM_RTOL, (diff, run.norms, ref.norms)
    assert diff["param_abs"] <= PARAM_ATOL, diff
    # Training moved the weights: parity of a run that changed nothing would prove nothing.
    assert ref.losses[-1] < ref.losses[0]
