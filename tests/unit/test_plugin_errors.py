"""Bad input is refused by attach()/prepare() with a message naming the value and the fix.

These run in one process with no process group at all: had any check needed a collective, it would fail
with "Default process group has not been initialized" instead of the expected message, so each test also
proves the refusal comes before any communication.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.testing.models import tiny_config


def fake_accelerator(num_processes=4, **overrides):
    base = dict(
        distributed_type=DistributedType.MULTI_CPU,
        num_processes=num_processes,
        process_index=0,
        is_main_process=True,
        mixed_precision="no",
        device=torch.device("cpu"),
        split_batches=False,
        _models=[],
        _optimizers=[],
        _dataloaders=[],
        _schedulers=[],
    )
    base.update(overrides)
    acc = SimpleNamespace(**base)
    for name in ("prepare", "backward", "clip_grad_norm_", "get_state_dict"):
        setattr(acc, name, lambda *a, **k: pytest.fail("the original Accelerator method must not be reached"))
    return acc


def tiny_model(family="llama", **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "a check started communicating"


def test_product_of_sizes_must_equal_world_size():
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2, tp_size=4))
    with pytest.raises(ValueError) as err:
        plugin.attach(fake_accelerator(num_processes=4))
    msg = str(err.value)
    assert "= 8" in msg and "world size is 4" in msg and "tp_size(4)" in msg


def test_dp_shard_minus_one_takes_the_ranks_left():
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=-1, tp_size=2)).attach(fake_accelerator(8))
    assert plugin.config.dp_shard_size == 4


def test_dp_shard_minus_one_that_does_not_divide():
    with pytest.raises(ValueError, match="6"):
        NDParallelPlugin(ParallelismConfig(dp_shard_size=-1, tp_size=4)).attach(fake_accelerator(6))


def test_cpu_accelerator_that_missed_the_launched_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match=r"Accelerator\(cpu=True\)"):
        NDParallelPlugin(ParallelismConfig()).attach(fake_accelerator(num_processes=1))


@pytest.mark.parametrize("tp,label,valid", [(3, "num_attention_heads=4", "[1, 2, 4]"),
                                            (4, "num_key_value_heads=2", "[1, 2]")])
def test_tp_must_divide_heads_and_kv_heads(tp, label, valid):
    plugin = NDParallelPlugin(ParallelismConfig(tp_size=tp)).attach(fake_accelerator(tp))
    with pytest.raises(ValueError) as err:
        plugin.prepare(tiny_model())
    assert f"tp_size={tp}" in str(err.value) and label in str(err.value) and valid in str(err.value)


def test_model_without_tp_plan_is_refused_under_tp():
    from transformers import AutoModelForCausalLM, GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    plugin = NDParallelPlugin(ParallelismConfig(tp_size=2)).attach(fake_accelerator(2))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no tp_plan.*tp_size=1"):
        plugin.prepare(model)


def test_unsupported_tp_style_in_override():
    plugin = NDParallelPlugin(ParallelismConfig(tp_size=2, tp_plan={"model.layers.*.mlp.up_proj": "colwse"}))
    with pytest.raises(NotImplementedError, match="did you mean 'colwise'"):
        plugin.attach(fake_accelerator(2))


def test_model_style_we_cannot_apply_names_the_entry_and_the_override():
    plugin = NDParallelPlugin(ParallelismConfig(tp_size=2)).attach(fake_accelerator(2))
    model = tiny_model()
    # A style a later transformers may add (every 5.24 one is known: tests/unit/test_tp_styles.py).
    model._tp_plan = {**model.tp_plan, "model.layers.*.mlp": "future_style"}
    with pytest.raises(NotImplementedError, match=r"'model.layers.\*.mlp': 'future_style'.*tp_plan=\{'model.layers.\*.mlp': None\}"):
        plugin.prepare(model)


def test_batch_not_divisible_over_data_parallel_ranks_with_split_batches():
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2)).attach(fake_accelerator(2, split_batches=True))
    loader = DataLoader(list(range(12)), batch_size=3)
    with pytest.raises(ValueError, match=r"batch_size=3 .* 2 data-parallel ranks.*multiple of 2"):
        plugin.prepare(loader)


def test_already_sharded_model_is_refused():
    # A real DTensor needs a process group; treating nn.Parameter as "DTensor" makes every weight look sharded.
    model = tiny_model()
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2)).attach(fake_accelerator(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("nd_parallel.distributed.parallelize.DTensor", torch.nn.Parameter)
        with pytest.raises(ValueError, match="already holds DTensor parameters"):
            plugin.prepare(model)


def test_optimizer_that_already_stepped_is_refused():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2)).attach(fake_accelerator(2))
    with pytest.raises(ValueError, match="already has state.*before the first step"):
        plugin.prepare(model, opt)


def test_mixed_precision_is_refused_with_the_fix():
    with pytest.raises(NotImplementedError, match="mixed_precision='fp8'.*use mixed_precision='bf16'"):
        NDParallelPlugin(ParallelismConfig()).attach(fake_accelerator(1, mixed_precision="fp8"))


def _prepare_cp(model, num_processes=2, **layout):
    plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(fake_accelerator(num_processes))
    plugin.prepare(model)


def test_ulysses_needs_heads_divisible_by_cp():
    # tiny llama: 4 query heads, 2 kv heads; cp=4 divides neither the kv heads
    with pytest.raises(ValueError, match="cp_size=4.*num_key_value_heads=2.*ring"):
        _prepare_cp(tiny_model(), 4, cp_size=4, cp_backend="ulysses")


def test_ulysses_heads_counted_after_tensor_parallel():
    # tp=2 leaves 2 query and 1 kv head per rank: cp=2 cannot split one kv head
    with pytest.raises(ValueError, match="cp_size=2.*num_key_value_heads=1"):
        _prepare_cp(tiny_model(), 4, cp_size=2, tp_size=2, cp_backend="ulysses")


def test_torch_cp_backend_is_refused_on_cpu_with_the_fix():
    with pytest.raises(NotImplementedError, match="cp_backend='torch'.*CUDA only.*cp_backend='ring'"):
        _prepare_cp(tiny_model(), 2, cp_size=2, cp_backend="torch")


def test_cp_refuses_a_model_that_bypasses_the_attention_interface():
    model = tiny_model()
    model._supports_attention_backend = False  # as for architectures with hand-written attention
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM computes attention in its own code.*cp_size=1"):
        _prepare_cp(model, 2, cp_size=2)


def test_cp_refuses_attention_dropout():
    with pytest.raises(NotImplementedError, match="attention_dropout=0.1.*attention_dropout=0.0"):
        _prepare_cp(tiny_model(attention_dropout=0.1), 2, cp_size=2)


def test_unsupported_accelerator_type():
    acc = fake_accelerator(2, distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(NotImplementedError, match="DEEPSPEED"):
        NDParallelPlugin(ParallelismConfig(dp_shard_size=2)).attach(acc)


def test_plugin_takes_config_or_sizes_not_both():
    with pytest.raises(ValueError, match="not both"):
        NDParallelPlugin(ParallelismConfig(), tp_size=2)
