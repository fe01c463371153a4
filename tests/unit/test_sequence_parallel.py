"""Sequence parallelism under TP: the option, the plan derived from a model's structure, and the refusals before any
collective. Parity (tp2, fsdp2_tp2, pp2_tp2, cp2_tp2 with SP on by default) is in tests/distributed/test_parity.py."""

import warnings

import pytest
import torch.distributed as dist

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.config import ConfigError
from nd_parallel.distributed.sequence_parallel import SequencePlan, sequence_plan
from nd_parallel.distributed.tensor_parallel import expand_plan, match_plan, resolve_plan
from tests.unit.test_plugin_errors import fake_accelerator, tiny_model

MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    yield
    assert not dist.is_initialized(), "a check started communicating"


def plan_of(model):
    return sequence_plan(model, expand_plan(model, match_plan(model, resolve_plan(model, None))))


def test_default_is_auto_and_bad_values_are_refused_with_the_fix():
    assert ParallelismConfig().sequence_parallel == "auto"
    assert ParallelismConfig.from_dict({"sequence_parallel": False}).sequence_parallel is False
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match=r"sequence_parallel=.*use True, False or 'auto'"):
            ParallelismConfig(sequence_parallel=bad)


def test_explicit_true_without_tp_warns():
    with pytest.warns(UserWarning, match=r"sequence_parallel=True has no effect with tp_size=1.*tp_size > 1"):
        ParallelismConfig(sequence_parallel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default and False say nothing
        ParallelismConfig()
        ParallelismConfig(sequence_parallel=False, tp_size=1)


def test_llama_plan_from_structure():
    plan = plan_of(tiny_model("llama", num_hidden_layers=2))
    assert isinstance(plan, SequencePlan)
    assert plan.regions == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")]
    assert plan.rowwise == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj")]
    # pre-norms of both regions and the final norm run on this rank's tokens; the stream is gathered after the latter
    assert plan.norms == [*(f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm",
                                                                               "post_attention_layernorm")),
                          "model.norm"]
    assert plan.exit == "model.norm"


def test_sandwich_norms_and_per_head_norms():
    gemma2 = plan_of(tiny_model("gemma2", num_hidden_layers=1))
    assert {n.rpartition(".")[2] for n in gemma2.norms} == {"input_layernorm", "post_attention_layernorm",
                                                            "pre_feedforward_layernorm", "post_feedforward_layernorm",
                                                            "norm"}
    qwen3 = plan_of(tiny_model("qwen3", num_hidden_layers=1))
    assert not any("q_norm" in n or "k_norm" in n for n in qwen3.norms)  # inside the attention region, as under TP


def test_moe_plan_keeps_sp_off_with_the_reason():
    reason = plan_of(tiny_model("mixtral", num_hidden_layers=1, **MOE))
    assert isinstance(reason, str) and "moe_tp_experts" in reason


def test_explicit_true_on_a_moe_plan_is_refused_before_any_collective():
    model = tiny_model("mixtral", num_hidden_layers=1, **MOE)
    plugin = NDParallelPlugin(ParallelismConfig(tp_size=2, sequence_parallel=True)).attach(fake_accelerator(2))
    with pytest.raises(NotImplementedError, match=r"sequence_parallel=True is not exact for MixtralForCausalLM: "
                                                  r".*moe_tp_experts.*use sequence_parallel='auto'.*or False"):
        plugin.prepare(model)


def test_planner_splits_the_norms_under_sequence_parallelism():
    from nd_parallel.planner.layout import Training
    from nd_parallel.planner.memory import layer_activation_bytes
    from nd_parallel.planner.spec import model_spec

    spec = model_spec(tiny_model("llama", num_hidden_layers=2))
    h = spec.hidden
    for dtype, norm in (("fp32", 12), ("bf16", 8)):
        b = 4 if dtype == "fp32" else 2
        on, off = (Training(seq_len=1024, global_batch=4, dtype=dtype, sequence_parallel=sp) for sp in (True, False))
        for tp in (2, 4):
            # two norms: fp32 input and normalised value and the rsqrt ÷ tp; the gathered output (the colwise
            # linears' saved input) stays whole
            saved = 2 * ((norm - b) * h + 4)
            assert layer_activation_bytes(spec, off, tp, "none")[0] - layer_activation_bytes(spec, on, tp, "none")[0] \
                == pytest.approx(saved * (1 - 1 / tp))
            assert layer_activation_bytes(spec, on, tp, "full")[0] == pytest.approx(b * h / tp)  # the layer input
        assert layer_activation_bytes(spec, on, 1, "none") == layer_activation_bytes(spec, off, 1, "none")
