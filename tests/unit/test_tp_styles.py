"""Every TP style transformers declares, and the plans we refuse before any collective (MoE / MLA models)."""

import pytest
import torch.distributed as dist

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.distributed.tensor_parallel import STYLES, check_param_entries, resolve_plan
from nd_parallel.distributed.tensor_parallel_styles import param_placement
from nd_parallel.testing.models import tiny_config
from tests.unit.test_plugin_errors import fake_accelerator

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)


def qwen3_moe(**overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", **{**MOE, **overrides}))


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    yield
    assert not dist.is_initialized(), "a check started communicating"


def test_every_style_in_every_installed_plan_is_known():
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    declared = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = CONFIG_MAPPING[model_type]().get_text_config()
        except Exception:  # a config that needs arguments to build: its class attribute still holds the plan
            config = CONFIG_MAPPING.get(model_type)
        for style in (getattr(config, "base_model_tp_plan", None) or {}).values():
            declared.setdefault(style, model_type)
    assert {"moe_tp_experts", "packed_colwise", "mla_kv_a_proj"} <= set(declared)  # the enumeration found them
    assert set(declared) - set(STYLES) == set(), {s: declared[s] for s in set(declared) - set(STYLES)}


def test_expert_weights_split_as_transformers_splits_them():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert param_placement("packed_colwise", "gate_up_proj", 3) == _StridedShard(1, split_factor=2)  # [E, 2I, H]
    assert param_placement("rowwise", "down_proj", 3) == Shard(2)  # [E, H, I]: the input features
    assert param_placement("colwise", "down_proj", 3) == Shard(1)  # llama4's [E, I, H]
    assert param_placement("packed_rowwise", "gate_up_proj", 3) == _StridedShard(2, split_factor=2)  # [E, H, 2I]
    assert param_placement("colwise", "sinks", 1) == Shard(0)
    assert param_placement("rowwise", "bias", 1) is None and param_placement("replicate", "w", 2) is None


def test_qwen3_moe_plan_resolves_and_passes_the_checks():
    model = qwen3_moe()
    plan = resolve_plan(model, None)
    assert plan["model.layers.*.mlp.experts"] == "moe_tp_experts"
    check_param_entries(model, plan, 2)


def test_unknown_style_in_a_moe_override_is_refused_before_any_collective():
    plugin = NDParallelPlugin(ParallelismConfig(tp_size=2, tp_plan={"model.layers.*.mlp.experts": "moe_tp_expert"}))
    with pytest.raises(NotImplementedError, match="'moe_tp_expert' is not a supported style; did you mean "
                                                  "'moe_tp_experts'"):
        plugin.attach(fake_accelerator(2))


def _refused(model, overrides, error, match):
    plugin = NDParallelPlugin(ParallelismConfig(tp_size=2, tp_plan=overrides)).attach(fake_accelerator(2))
    with pytest.raises(error, match=match):
        plugin.prepare(model)


def test_split_expert_weights_whose_module_runs_on_dtensors_are_refused():
    _refused(qwen3_moe(), {"model.layers.*.mlp.experts": None}, NotImplementedError,
             r"splits the parameter 'model.layers.0.mlp.experts.gate_up_proj' \(packed_colwise\).*"
             r"tp_plan=\{'model.layers.0.mlp.experts': 'local_params'\}.*"
             r"tp_plan=\{'model.layers.\*.mlp.experts.gate_up_proj': None\}")


def test_whole_expert_weight_under_moe_tp_experts_is_refused():
    _refused(qwen3_moe(), {"model.layers.*.mlp.experts.down_proj": None}, NotImplementedError,
             r"'model.layers.0.mlp.experts.down_proj' is whole on every rank.*tp_size=2 times")


def test_expert_width_that_tp_does_not_split_evenly_is_refused():
    _refused(qwen3_moe(moe_intermediate_size=15), None, ValueError,
             r"tp_size=2 does not split dim 1 \(size 30, two packed halves\) of "
             r"'model.layers.0.mlp.experts.gate_up_proj' \(packed_colwise\) evenly; use tp_size in \[1, 3, 5, 15\]")


def test_module_style_given_to_a_parameter_is_refused():
    _refused(qwen3_moe(), {"model.layers.*.mlp.experts.down_proj": "moe_tp_experts"}, ValueError,
             r"'moe_tp_experts' places modules, but it matched the parameter 'model.layers.0.mlp.experts.down_proj'")


def test_moe_tp_experts_on_a_dense_mlp_is_refused():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    _refused(model, {"model.layers.*.mlp": "moe_tp_experts"}, NotImplementedError,
             r"'model.layers.\*.mlp': 'moe_tp_experts' is for a module holding stacked expert weights.*"
             r"tp_plan=\{'model.layers.\*.mlp': None\}")


def test_packed_rowwise_on_a_module_is_refused():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    _refused(model, {"model.layers.*.mlp.up_proj": "packed_rowwise"}, ValueError,
             r"packed_rowwise places parameters, but 'model.layers.0.mlp.up_proj' matched the module Linear")


def test_mla_style_on_a_model_without_a_rope_part_is_refused():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    _refused(model, {"model.layers.*.self_attn.k_proj": "mla_kv_a_proj"}, ValueError,
             r"mla_kv_a_proj needs qk_rope_head_dim in LlamaConfig")


def test_outputs_modified_in_place_read_from_the_source():
    """llama4's MoE block adds the routed experts into the shared expert's output in place: under TP that output is
    a view to_local returned, so it is cloned (tensor_parallel_styles.clone_outputs_modified_in_place)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.llama4 import modeling_llama4

    from nd_parallel.models.hf import outputs_modified_in_place

    assert outputs_modified_in_place(object.__new__(modeling_llama4.Llama4TextMoe)) == {"shared_expert"}
    assert outputs_modified_in_place(object.__new__(modeling_llama.LlamaMLP)) == set()


def test_packed_weight_loads_as_several_boxes():
    """A packed TP placement alone (each rank's slice of both halves) is not one box; each tensor dim is cut by one
    mesh dim at most, so the loader cuts it from the whole tensor; two cuts on one dim are still refused."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from nd_parallel.models.loading import is_one_box, one_dim_each

    assert not is_one_box((_StridedShard(2, split_factor=2),), (2,))
    assert one_dim_each((Shard(0), _StridedShard(2, split_factor=2)))
    assert not one_dim_each((Shard(0), _StridedShard(0, split_factor=2)))


def test_scalar_parameters_inside_a_tp_region_get_their_gradient_all_reduced():
    """Apertus' xIELU (alpha_p, alpha_n: scalars) runs between colwise up_proj and rowwise down_proj on each
    rank's shard of the features; its plan omits it, so its gradient was a partial sum (TP2 parameters 8e-4 off in
    the model sweep). Norms beside the region (MLA's q_a_layernorm: not scalar) are left alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.tensor_parallel import match_plan, resolve_plan
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    for model_type, expected in (("apertus", {"model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"}),
                                 ("deepseek_v3", set())):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_sweep_config(model_type))
        matched = match_plan(model, resolve_plan(model, None))
        added = {n for n, s in matched.items() if s == "replicated_with_grad_allreduce" and "norm" not in n}
        assert added == expected, (model_type, added)


def test_per_head_norms_the_plan_leaves_out_get_their_gradient_all_reduced():
    """Glm4Moe-style attention with use_qk_norm (SarvamMoE; GLM-4.5's checkpoints turn it on) normalises each
    head of q_proj's "colwise" output with q_norm / k_norm, which its plan does not name: their gradient is a
    partial sum over tp and gets Qwen3's style. A norm on a gathered output (MiniMax-M3's colwise_gather_output)
    or on a projection the plan does not split (an MLA kv_a_layernorm) is left alone."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.tensor_parallel import match_plan, resolve_plan
    from nd_parallel.distributed.tensor_parallel_styles import per_head_norms
    from nd_parallel.testing.tiny_configs import tiny_sweep_config

    def found(model_type, **overrides):
        model = AutoModelForCausalLM.from_config(tiny_sweep_config(model_type, **overrides))
        return sorted(per_head_norms(model, match_plan(model, resolve_plan(model, None))))

    assert found("sarvam_moe")[:2] == ["model.layers.0.self_attn.k_norm", "model.layers.0.self_attn.q_norm"]
    assert found("glm4_moe", use_qk_norm=True)[:2] == ["model.layers.0.self_attn.k_norm",
                                                        "model.layers.0.self_attn.q_norm"]
    assert found("glm4_moe") == found("qwen3") == found("minimax_m3_vl_text") == found("deepseek_v3") == []
