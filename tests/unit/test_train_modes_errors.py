"""Bad precision / checkpointing input is refused before any collective, naming the value and the fix."""

import gc

import pytest
import torch
import torch.nn as nn

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.config import ConfigError
from nd_parallel.distributed.activation_checkpoint import CheckpointedForward, apply_activation_checkpointing
from nd_parallel.distributed.precision import check_mixed_precision, policy_for

from .test_plugin_errors import fake_accelerator, no_process_group, tiny_model  # noqa: F401 (autouse fixture)


@pytest.mark.parametrize("value,expected", [
    ("fp8", "fp8' is not supported"),
    ("bf32", "mixed_precision='bf32' is not a precision; use 'no' (fp32), 'bf16' or 'fp16'"),
])
def test_unsupported_mixed_precision_refused_at_attach(value, expected):
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2))
    with pytest.raises((ValueError, NotImplementedError)) as err:
        plugin.attach(fake_accelerator(num_processes=2, mixed_precision=value))
    assert expected in str(err.value)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_with_deepspeed_pipeline_refused(precision):
    pytest.importorskip("deepspeed")
    plugin = NDParallelPlugin(ParallelismConfig(pp_size=2, pp_backend="deepspeed"))
    with pytest.raises(NotImplementedError, match=f"mixed_precision='{precision}'.*use pp_backend='torch'"):
        plugin.attach(fake_accelerator(num_processes=2, mixed_precision=precision))


def test_bf16_policy_keeps_fp32_reduction():
    policy = policy_for("bf16")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    policy = policy_for("fp16")
    assert policy.param_dtype == torch.float16 and policy.reduce_dtype == torch.float32
    assert policy_for("no") is None and policy_for(None) is None
    check_mixed_precision("no")


@pytest.mark.parametrize("value", ["ful", "Full", "sel", True, 1])
def test_unknown_activation_checkpointing_mode(value):
    with pytest.raises(ConfigError) as err:
        ParallelismConfig(activation_checkpointing=value)
    assert f"activation_checkpointing={value!r} is not a mode" in str(err.value) and "'selective'" in str(err.value)


def test_checkpointing_every_must_be_positive():
    with pytest.raises(ConfigError, match="activation_checkpointing_every=0"):
        ParallelismConfig(activation_checkpointing="full", activation_checkpointing_every=0)


class NoLayers(nn.Module):
    """A causal-LM-shaped module with nothing that looks like a stack of decoder layers."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


def test_checkpointing_a_model_without_layers_refused_at_prepare():
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2, activation_checkpointing="full"))
    plugin.attach(fake_accelerator(num_processes=2))
    with pytest.raises(ValueError) as err:
        plugin.prepare(NoLayers())
    assert "NoLayers has no stack of decoder layers" in str(err.value)
    assert "activation_checkpointing=None" in str(err.value)


def test_checkpointing_wraps_each_kth_layer_and_keeps_names():
    model = tiny_model(num_hidden_layers=4)
    names = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, "full", every=2) == 2
    wrapped = [isinstance(layer.forward, CheckpointedForward) for layer in model.model.layers]
    assert wrapped == [True, False, True, False]
    assert [n for n, _ in model.named_parameters()] == names  # HF names unchanged
    assert apply_activation_checkpointing(model, "full", every=2) == 0  # idempotent


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_changes_no_gradient_in_one_process(mode):
    torch.manual_seed(0)
    ids = torch.randint(1, 256, (2, 16))
    grads = {}
    for m in (None, mode):
        torch.manual_seed(0)
        model = tiny_model(num_hidden_layers=2)
        apply_activation_checkpointing(model, m)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[m] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(torch.equal(grads[None][n], grads[mode][n]) for n in grads[None])


def test_hf_switch_is_taken_over():
    from nd_parallel.distributed.activation_checkpoint import requested_mode

    model = tiny_model(num_hidden_layers=2)
    model.gradient_checkpointing_enable()
    assert requested_mode(model, None) == "full"
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers)
    assert requested_mode(model, "selective") == "selective"


def test_checkpointing_modes_keep_different_bytes():
    """What a training forward holds for backward: "full" keeps each layer's input only, "selective" also the outputs
    of the matmuls (and attention), no checkpointing everything autograd saves. A "selective" that recomputed
    everything would equal "full"; one that saved everything would keep at least what no checkpointing keeps."""
    from nd_parallel.planner.measure import LiveTensorBytes

    batch, seq, layers = 2, 64, 2
    ids = torch.randint(1, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    held = {}
    for mode in (None, "selective", "full"):
        torch.manual_seed(0)
        model = tiny_model(num_hidden_layers=layers)
        apply_activation_checkpointing(model, mode)
        with LiveTensorBytes([]) as live:
            out = model(input_ids=ids, labels=ids)
            gc.collect()  # only what the forward keeps for backward, not garbage awaiting the collector
            held[mode] = live.current
        out.loss.backward()
    print(f"held after forward: none {held[None]} selective {held['selective']} full {held['full']} bytes")
    assert held["full"] < held["selective"] < held[None], held
    # "selective" keeps every Linear's output of every layer (fp32 here), which "full" recomputes
    linear_out = sum(m.out_features for m in model.model.layers[0].modules() if isinstance(m, nn.Linear))
    assert held["selective"] - held["full"] >= layers * batch * seq * linear_out * 4, held


def test_fp16_refuses_trainable_fp16_weights_before_any_collective():
    """fp16 mixed precision keeps fp32 master weights: a model loaded in fp16 is refused at prepare, with the fix."""
    model = tiny_model().to(torch.float16)
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2)).attach(
        fake_accelerator(num_processes=2, mixed_precision="fp16", scaler=None))
    with pytest.raises(ValueError, match="trainable fp16 parameter.*load the model in fp32"):
        plugin.prepare(model)
