"""Expert parallelism without processes: ep_size's checks (before any collective) and where the experts are found.

The parity rows (tests/distributed/test_parity.py, launch "ep4r") prove the training itself.
"""

import pytest
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.config.checks import ConfigError
from nd_parallel.models.moe import expert_modules, num_experts
from nd_parallel.testing.models import tiny_config

from .test_plugin_errors import fake_accelerator

MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
       "olmoe": dict(num_experts=4, num_experts_per_tok=2),
       "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2)}


def model_of(family, **overrides):
    return AutoModelForCausalLM.from_config(tiny_config(family, **{**MOE.get(family, {}), **overrides}))


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "a check started communicating"


def test_ep_size_is_an_option_not_a_size():
    config = ParallelismConfig(dp_shard_size=4, ep_size=2)
    assert config.world_size == 4 and config.ep_size == 2  # borrowed from dp_shard, no rank added
    assert "ep_size=2" in config.describe()


@pytest.mark.parametrize("kwargs,needle", [
    (dict(dp_shard_size=3, ep_size=2), "ep_size=2 does not fit dp_shard_size=3"),
    (dict(dp_shard_size=1, ep_size=2), "ep_size in [1]"),
    (dict(dp_replicate_size=2, ep_size=2), "ep_size=2 does not fit dp_shard_size=1"),  # replicas are not borrowed
    (dict(ep_size=0), "ep_size=0 must be a positive integer; use ep_size=1 to disable"),
    (dict(ep_size=2.0), "write ep_size=2"),
    (dict(dp_shard_size=2, pp_size=2, ep_size=2, pp_backend="deepspeed"), "deepspeed"),
])
def test_ep_size_refused_by_the_config(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        ParallelismConfig(**kwargs)
    assert needle in str(err.value)


def test_ep_with_tp_keeps_the_experts_out_of_the_tp_plan():
    """EP x TP (torchtitan's etp=1): the experts' entries leave the plan, attention and dense MLPs keep theirs."""
    from nd_parallel.distributed.tensor_parallel import plan_overrides, resolve_plan

    model = model_of("qwen3_moe", mlp_only_layers=[0], intermediate_size=64)
    config = ParallelismConfig(dp_shard_size=2, tp_size=2, ep_size=2)
    assert config.world_size == 4
    plan = resolve_plan(model, plan_overrides(model, config))
    assert not any(".experts" in key for key in plan)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    without_ep = resolve_plan(model, plan_overrides(model, ParallelismConfig(tp_size=2)))
    assert without_ep["model.layers.*.mlp.experts"] == "moe_tp_experts"  # TP alone still splits the experts


def test_ep_with_tp_refuses_an_entry_around_the_experts():
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2, tp_size=2, ep_size=2,
                                                tp_plan={"model.layers.*.mlp": "all_reduce"})).attach(fake_accelerator(4))
    with pytest.raises(NotImplementedError, match=r"tp_plan entry 'model.layers.\*.mlp': 'all_reduce' on a module "
                                                  r"around the experts 'model.layers.0.mlp.experts' cannot be exact "
                                                  r"with ep_size=2.*tp_plan=\{'model.layers.\*.mlp': None\}"):
        plugin.prepare(model_of("mixtral"))


def test_ep_size_checked_again_when_dp_shard_is_resolved():
    config = ParallelismConfig(dp_shard_size=-1, ep_size=4)
    assert config.resolve(8).dp_shard_size == 8
    with pytest.raises(ConfigError, match=r"ep_size=4 does not fit dp_shard_size=6.*ep_size in \[1, 2, 3, 6\]"):
        config.resolve(6)


def test_ep_size_from_the_launcher_environment():
    env = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "4", "PARALLELISM_CONFIG_EP_SIZE": "2"}
    assert ParallelismConfig.from_env(env).ep_size == 2
    assert ParallelismConfig.from_dict({"dp_shard_size": 4, "ep_size": 4}).ep_size == 4


def test_ep_size_on_a_dense_model_is_refused_before_any_collective():
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2, ep_size=2)).attach(fake_accelerator(2))
    with pytest.raises(ValueError, match=r"ep_size=2 needs a mixture-of-experts model, but LlamaForCausalLM "
                                         r"declares no experts.*use ep_size=1"):
        plugin.prepare(model_of("llama"))


def test_ep_size_must_divide_the_experts():
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=6, ep_size=3)).attach(fake_accelerator(6))
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide the 4 experts of MixtralForCausalLM.*"
                                         r"ep_size in \[1, 2\]"):
        plugin.prepare(model_of("mixtral"))


@pytest.mark.parametrize("family", sorted(MOE))
def test_experts_found_from_the_ep_plan_and_from_the_structure_alike(family):
    model = model_of(family)
    from_plan = [(e.name, e.stacked) for e in expert_modules(model)]
    assert [n for n, _ in from_plan] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all("gate_up_proj" in s and "down_proj" in s for _, s in from_plan)
    assert num_experts(model) == 4
    model.config.base_model_ep_plan = None  # a family without a plan: found by its structure
    assert [(e.name, e.stacked) for e in expert_modules(model)] == from_plan


def test_dense_model_has_no_experts():
    assert expert_modules(model_of("llama")) == [] and num_experts(model_of("llama")) is None


@pytest.mark.parametrize("sizes", [dict(cp_size=2), dict(pp_size=2)])
def test_router_loss_refused_where_it_is_not_made_global(sizes):
    model = model_of("mixtral", output_router_logits=True)
    plugin = NDParallelPlugin(ParallelismConfig(**sizes)).attach(fake_accelerator(2))
    name = next(iter(sizes))
    with pytest.raises(NotImplementedError, match=rf"output_router_logits=True .* with {name}=2 is not supported yet"):
        plugin.prepare(model)
