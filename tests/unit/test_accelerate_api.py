"""Accelerate's ParallelismConfig API on ours (config/accelerate_api.py), the launch file's keys, and their refusals.

Attribute parity: every public attribute of ``accelerate.parallelism_config.ParallelismConfig`` exists on ours with the
same value for the same sizes, in the installed accelerate (1.15) and in accelerate 1.13 (the Axolotl venv's, built by
.ci/axolotl-venv; ND_PARALLEL_ACCELERATE_PYTHON names another interpreter). A new attribute there fails here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn as nn

from nd_parallel import ParallelismConfig
from nd_parallel.accelerate.accelerate_config import refuse_different_sizes
from nd_parallel.accelerate.launch_keys import apply_fsdp_keys, check_wrap_class
from nd_parallel.config import ConfigError
from tests.unit.accelerate_api_dump import LAYOUTS, describe

ROOT = Path(__file__).resolve().parents[2]
DUMP = Path(__file__).with_name("accelerate_api_dump.py")
# The Axolotl venv (accelerate 1.13), found as test_axolotl_plugin.py finds it; ND_PARALLEL_ACCELERATE_PYTHON: another.
AXOLOTL_VENV = Path(os.environ.get("ND_PARALLEL_AXOLOTL_VENV", ROOT / ".venv-axolotl"))
OTHER_PYTHON = Path(os.environ.get("ND_PARALLEL_ACCELERATE_PYTHON", AXOLOTL_VENV / "bin" / "python"))
# Attributes whose value differs on purpose, with the reason (the test fails on any other difference).
DIFFERENT = {
    "cp_backend": "ours: 'ring' (default) / 'ulysses' / 'torch'; Accelerate has only 'torch'",
    "tp_handler": "Accelerate fills in TorchTensorParallelConfig() when tp_size > 1; ours keeps what was given (None)",
    "cp_handler": "Accelerate fills in TorchContextParallelConfig() when cp_size > 1; ours keeps what was given (None)",
}


def _dump(python) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PARALLELISM_CONFIG_")}
    out = subprocess.run([str(python), str(DUMP)], capture_output=True, text=True, env=env, check=True, timeout=300)
    return json.loads(out.stdout)


def _compare(theirs: dict) -> None:
    for layout, want in zip(LAYOUTS, theirs["layouts"]):
        got = json.loads(json.dumps(describe(ParallelismConfig(**layout)), default=repr))
        missing = sorted(set(want) - set(got))
        assert not missing, f"accelerate {theirs['version']} has attributes ours lacks: {missing}"
        wrong = {k: (got[k], v) for k, v in want.items() if k not in DIFFERENT and got[k] != v}
        assert not wrong, f"{layout}: ours vs accelerate {theirs['version']}: {wrong}"
    # Every constructor argument of Accelerate's is one of ours
    accepted = ParallelismConfig(**{f: getattr(ParallelismConfig(), f) for f in theirs["fields"]})
    assert accepted.sp_size == 1


def test_same_attributes_and_values_as_installed_accelerate():
    _compare(_dump(sys.executable))


def test_same_attributes_and_values_as_accelerate_113():
    if not OTHER_PYTHON.is_file():  # in CI (.ci/run builds the venv first) a missing one fails, as the Axolotl tests
        why = (f"no second interpreter at {OTHER_PYTHON}: build .venv-axolotl (.ci/axolotl-venv, accelerate 1.13) or "
               "set ND_PARALLEL_ACCELERATE_PYTHON")
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"CI: {why}", pytrace=False)
        pytest.skip(why)
    theirs = _dump(OTHER_PYTHON)
    assert theirs["version"] != _dump(sys.executable)["version"]
    _compare(theirs)


def test_pipeline_joins_the_dimensions_that_share_a_batch():
    c = ParallelismConfig(dp_shard_size=2, tp_size=2, pp_size=2)
    assert c.non_dp_dim_names == ["tp", "pp"] and c.non_data_parallel_size == 4 and c.total_size == 8
    assert c.data_parallel_size == 2 and c.active_mesh_dims == ["dp_shard", "tp", "pp"] and c.pp_enabled


def test_constructor_reads_the_launch_environment_for_what_is_not_given(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "2")
    assert (ParallelismConfig().tp_size, ParallelismConfig().pp_size) == (2, 2)  # as Accelerate's ParallelismConfig()
    assert ParallelismConfig(tp_size=1).tp_size == 1  # given beats the environment
    # the readers state their own levels: the environment is not added behind their back
    assert ParallelismConfig.from_dict({"dp_shard_size": 2}).tp_size == 1
    assert ParallelismConfig.from_env({"PARALLELISM_CONFIG_CP_SIZE": "2"}).tp_size == 1
    c = ParallelismConfig(dp_shard_size=2)
    assert c.resolve(8).tp_size == 2  # replace() passes every field


@pytest.mark.parametrize("kwargs,match", [
    (dict(sp_size=2), r"sp_size=2: Accelerate's DeepSpeed sequence parallelism .* cp_backend='ulysses'"),
    (dict(sp_backend="ring"), r"sp_backend='ring' is not one of Accelerate's values"),
    (dict(sp_handler=object()), r"sp_handler=.* configures DeepSpeed's sequence parallelism"),
])
def test_sequence_parallel_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelismConfig(**kwargs)


def test_handlers_accelerate_fills_in_are_accepted_and_others_refused():
    from accelerate.utils import TorchContextParallelConfig, TorchTensorParallelConfig

    ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(), cp_size=2,
                      cp_handler=TorchContextParallelConfig())
    with pytest.raises(ConfigError, match=r"enable_async_tp=True\): asynchronous TP .* is not implemented"):
        ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(enable_async_tp=True))
    with pytest.raises(ConfigError, match=r"cp_handler.cp_comm_strategy='alltoall': .* choose cp_backend instead"):
        ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall"))


def test_cp_comm_strategy_of_the_launch_file():
    env = {"PARALLELISM_CONFIG_CP_SIZE": "2", "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "allgather"}
    assert ParallelismConfig.from_env(env).cp_size == 2  # the launcher's own default: says nothing
    with pytest.raises(ConfigError, match=r"CP_COMM_STRATEGY='alltoall': it picks how torch's context_parallel"):
        ParallelismConfig.from_env({**env, "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "alltoall"})
    with pytest.raises(ConfigError, match=r"'ring-ish' is not even one of Accelerate's values"):
        ParallelismConfig.from_env({**env, "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "ring-ish"})
    with pytest.raises(ConfigError, match=r"SP_BACKEND='megatron' is not one of accelerate's values"):
        ParallelismConfig.from_env({**env, "PARALLELISM_CONFIG_SP_BACKEND": "megatron"})


# The FSDP_* variables `accelerate launch` writes for a file with distributed_type: FSDP and no other fsdp key.
LAUNCHER_DEFAULTS = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
                     "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false",
                     "FSDP_MIN_NUM_PARAMS": "100000000", "FSDP_FORWARD_PREFETCH": "false",
                     "FSDP_USE_ORIG_PARAMS": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                     "FSDP_SYNC_MODULE_STATES": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false",
                     "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false"}


def test_fsdp_keys_at_the_launchers_defaults_or_ours_take_effect():
    config = ParallelismConfig(dp_shard_size=2)
    assert apply_fsdp_keys(config, LAUNCHER_DEFAULTS) == config
    cp_yaml = {**LAUNCHER_DEFAULTS, "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
               "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_ACTIVATION_CHECKPOINTING": "true",
               "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}  # Accelerate's examples/.../configs/cp.yaml
    assert apply_fsdp_keys(config, cp_yaml).activation_checkpointing == "full"
    assert apply_fsdp_keys(ParallelismConfig(activation_checkpointing="selective"), cp_yaml).activation_checkpointing \
        == "selective"  # the config's own mode is the more specific one
    assert apply_fsdp_keys(config, {"FSDP_OFFLOAD_PARAMS": "true"}) == config  # not an FSDP launch: not ours to read
    offload = apply_fsdp_keys(config, {**LAUNCHER_DEFAULTS, "FSDP_OFFLOAD_PARAMS": "true",
                                       "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"})
    assert offload.fsdp_offload_params and offload.activation_offloading  # the memory options of the same meaning


@pytest.mark.parametrize("var,value,match", [
    ("FSDP_RESHARD_AFTER_FORWARD", "false", r"fsdp_reshard_after_forward: 'false' cannot take effect"),
    ("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT", r"fsdp_state_dict_type: 'FULL_STATE_DICT' .* SHARDED_STATE_DICT"),
    ("FSDP_VERSION", "1", r"fsdp_version: '1' cannot take effect: nd_parallel shards with FSDP2"),
    ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP", r"fsdp_auto_wrap_policy: 'SIZE_BASED_WRAP' cannot take effect"),
    ("FSDP_SHARDING_STRATEGY", "HYBRID_SHARD", r"dp_replicate_size replicates \(HSDP\)"),
    ("FSDP_IGNORED_MODULES", "lm_head", r"FSDP_IGNORED_MODULES='lm_head' .* is not one nd_parallel knows"),
])
def test_fsdp_keys_we_cannot_honour_are_refused(var, value, match):
    with pytest.raises(ConfigError, match=match):
        apply_fsdp_keys(ParallelismConfig(dp_shard_size=2), {**LAUNCHER_DEFAULTS, var: value})


def _tiny_llama():
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def test_fsdp_wrap_class_must_be_the_decoder_layer():
    model = _tiny_llama()
    check_wrap_class(model, {"ACCELERATE_USE_FSDP": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"})
    with pytest.raises(ConfigError, match=r"'MistralDecoderLayer' cannot take effect: .* set it to LlamaDecoderLayer"):
        check_wrap_class(model, {"ACCELERATE_USE_FSDP": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "MistralDecoderLayer"})


def test_two_layouts_with_different_sizes_are_refused():
    from accelerate.parallelism_config import ParallelismConfig as Theirs

    ours = ParallelismConfig(dp_shard_size=2, tp_size=2)
    refuse_different_sizes(ours, Theirs(dp_shard_size=2, tp_size=2), "ours", "theirs")
    with pytest.raises(ConfigError, match=r"theirs says dp_shard_size=4, tp_size=1 but ours says dp_shard_size=2, "
                                          r"tp_size=2: two layouts for one run"):
        refuse_different_sizes(ours, Theirs(dp_shard_size=4, tp_size=1), "ours", "theirs")


class LmHeadWrapper(nn.Module):  # as Accelerate's tests/tp/fsdp2_tp_preparation.py wraps the head
    def __init__(self, lm_head):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, x):
        return self.lm_head(x)


def test_a_module_the_plan_style_cannot_split_is_refused_up_front():
    from nd_parallel.distributed.parallelize import check_model

    model = _tiny_llama()
    model.lm_head = LmHeadWrapper(model.lm_head)
    with pytest.raises(ValueError) as e:
        check_model(model, ParallelismConfig(tp_size=2), "cpu")
    assert ("`lm_head` is a LmHeadWrapper, the tp_plan style colwise_gather_output needs nn.Linear or nn.Embedding; "
            "pass ParallelismConfig(tp_plan={'lm_head': None, 'lm_head.lm_head': 'colwise_gather_output'})"
            in str(e.value))
    check_model(model, ParallelismConfig(tp_size=2, tp_plan={"lm_head": None}), "cpu")


ONE_PROCESS = """
import torch, nd_parallel
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig as Theirs
from nd_parallel import ParallelismConfig
from nd_parallel.accelerate.from_config import use_for_accelerate_configs
import os
os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"  # the launcher's default
acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
assert acc.nd_parallel.config == acc.parallelism_config and acc.torch_device_mesh is None
# off before the script's from_pretrained, so that every rank reads the checkpoint (launch_keys.py says why)
assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
t = torch.arange(4.0)
with acc.maybe_context_parallel(buffers=[t], buffer_seq_dims=[0], no_restore_buffers={t}):
    pass
assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
from accelerate.state import AcceleratorState
AcceleratorState._reset_state(True)
use_for_accelerate_configs()
acc = Accelerator(cpu=True, parallelism_config=Theirs())
assert isinstance(acc.parallelism_config, ParallelismConfig) and acc.nd_parallel is not None
print("ok")
"""


def test_accelerator_attaches_nd_parallel_from_its_parallelism_config():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARALLELISM_CONFIG_", "ACCELERATE_"))}
    out = subprocess.run([sys.executable, "-c", ONE_PROCESS], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
