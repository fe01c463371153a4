"""Memory options (nd_parallel/distributed/memory.py, config/memory.py): each trains exactly as the run without it.

One process, fp32, a tiny model: activation offloading is bit-equal (with and without activation checkpointing; the
host copies are exercised on CPU by treating CPU tensors as movable), tiled MLP matches the untiled run to fp32
reduction order, and FSDP2's CPUOffloadPolicy through the plugin on one rank is set and changes nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nd_parallel import ParallelismConfig
from nd_parallel.config import ConfigError
from nd_parallel.distributed import memory
from nd_parallel.distributed.activation_checkpoint import apply_activation_checkpointing
from nd_parallel.testing.models import make_samples, tiny_config
from nd_parallel.testing.parity import Recipe, train_reference


def _model(family="llama"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa")


def _train(model, steps=3):
    return train_reference(None, make_samples(8, 32, seed=1), 1, Recipe(steps=steps), model=model)


def _same(a, b, atol=0.0):
    assert len(a.losses) == len(b.losses)
    for x, y in zip(a.losses + a.norms, b.losses + b.norms):
        assert abs(x - y) <= atol * max(1.0, abs(y)), (a.losses, b.losses, a.norms, b.norms)
    for k in a.state:
        diff = (a.state[k] - b.state[k]).abs().max().item()
        assert diff <= atol, (k, diff)


@pytest.mark.parametrize("ac", [None, "full"])
def test_activation_offloading_is_bit_equal_and_moves_what_the_layer_saves(monkeypatch, ac):
    base = _model()
    ref_model = copy.deepcopy(base)
    apply_activation_checkpointing(ref_model, ac)
    ref = _train(ref_model)
    # On a CPU-only run nothing is moved; treat CPU tensors as movable so the host copies really happen.
    moved = []
    movable = lambda t: (isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)  # noqa: E731
                         and not moved.append(1))
    monkeypatch.setattr(memory, "_movable", movable)
    apply_activation_checkpointing(base, ac)
    assert memory.apply_activation_offloading(base) == 2
    assert memory.apply_activation_offloading(base) == 0  # idempotent
    run = _train(base)
    assert moved, "no saved tensor went through the offloading hooks"
    _same(ref, run)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiled_mlp_matches_untiled_in_fp32(family):
    base = _model(family)
    ref = _train(copy.deepcopy(base))
    hidden = base.config.hidden_size
    assert memory.apply_tiled_mlp(base, 4, hidden) == 2
    mlp = base.model.layers[0].mlp
    x = torch.randn(2, 32, hidden)
    with torch.no_grad():
        assert torch.equal(mlp(x), type(mlp).forward(mlp, x))  # per-token: the tiles' outputs are the untiled ones
    run = _train(base)
    # Forward is bit-equal; weight gradients sum over tiles instead of over all tokens at once, so the difference
    # is fp32 reduction order (measured ~1e-8 relative on the loss, < 1e-6 on every parameter after 3 AdamW steps).
    _same(ref, run, atol=1e-6)


def test_tiled_mlp_composes_with_checkpointing_and_offloading():
    base = _model()
    ref_model = copy.deepcopy(base)
    apply_activation_checkpointing(ref_model, "full")
    ref = _train(ref_model)
    apply_activation_checkpointing(base, "full")
    memory.apply_memory_options(base, ParallelismConfig(tiled_mlp=True, tiled_mlp_num_shards=2,
                                                        activation_offloading=True))
    _same(ref, _train(base), atol=1e-6)


def test_tiled_mlp_number_of_tiles():
    tiled = memory.TiledForward(None, None, hidden_size=64)
    assert [tiled.tiles(n) for n in (1, 64, 65, 300)] == [1, 1, 2, 5]
    assert memory.TiledForward(None, 8, 64).tiles(3) == 3


def test_tiled_mlp_is_refused_for_a_model_without_a_per_token_mlp():
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=32))
    with pytest.raises(ValueError, match=r"tiled_mlp=True: Qwen3MoeForCausalLM .*Qwen3MoeDecoderLayer.* tiled_mlp=False"):
        memory.check_tiled_mlp(moe)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tiled_mlp="yes"), r"tiled_mlp='yes' .*write True or False"),
    (dict(fsdp_offload_params=1), r"fsdp_offload_params=1 .*write True or False"),
    (dict(tiled_mlp_num_shards=2), r"tiled_mlp_num_shards=2 without tiled_mlp=True"),
    (dict(tiled_mlp=True, tiled_mlp_num_shards=0), r"tiled_mlp_num_shards=0"),
    (dict(fsdp_offload_params=True, pp_size=2, pp_backend="deepspeed"), r"fsdp_offload_params=True .*deepspeed"),
])
def test_bad_memory_options_are_refused(kwargs, match):
    with pytest.raises((ConfigError, TypeError), match=match):
        ParallelismConfig(**kwargs)


def test_fsdp_offload_params_sets_cpu_offload_policy_and_trains_the_same(tmp_path):
    from accelerate import Accelerator
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from nd_parallel import NDParallelPlugin
    from nd_parallel.testing.models import save_tiny_model
    from nd_parallel.testing.parity import train_layout

    model_dir = save_tiny_model("llama", tmp_path / "m")
    samples = make_samples(8, 32, seed=1)
    ref = train_reference(model_dir, samples, 1, Recipe(steps=3))
    accelerator = Accelerator()
    plugin = NDParallelPlugin(ParallelismConfig(fsdp_offload_params=True))
    plugin.attach(accelerator)
    try:
        run = train_layout(accelerator, plugin, model_dir, samples, Recipe(steps=3))
    finally:
        if torch.distributed.is_initialized():  # the one-rank group of fully_shard; later tests check none is left
            torch.distributed.destroy_process_group()
    groups = [m for m in run.model.modules() if isinstance(m, FSDPModule)]
    assert len(groups) == 3  # two decoder layers + the root, one rank
    assert all(isinstance(g._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy) for g in groups)
    _same(ref, run, atol=1e-6)
