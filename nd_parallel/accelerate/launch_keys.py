"""The ``fsdp_config`` keys of an ``accelerate launch`` config file: each takes effect under our layout, or is refused.

``accelerate launch`` turns every key of a config file's ``fsdp_config`` section into an ``FSDP_*`` variable, and
writes its own default for each key the file leaves out. So a value equal to the launcher's default says nothing;
any other value is either honoured by nd_parallel's FSDP2 layout (``fully_shard`` per decoder layer + the root,
resharded after forward, a sharded DCP checkpoint) or refused here, naming the key, why, and the fix. Nothing is
silently ignored. Read at the launcher boundary, when the plugin attaches (before any collective).
"""

from __future__ import annotations

import dataclasses
import os

from nd_parallel.config import ConfigError, ParallelismConfig

_TRUE = ("1", "true", "yes", "on")

# FSDP_* variable -> (values that match what nd_parallel does anyway, why, the fix for any other value).
_MATCH_OR_REFUSE = {
    "FSDP_VERSION": (("2",), "nd_parallel shards with FSDP2 (torch's fully_shard)", "set fsdp_version: 2"),
    "FSDP_SHARDING_STRATEGY": (("FULL_SHARD", "1"), "the sharding is the layout's: dp_shard_size shards, "
                               "dp_replicate_size replicates (HSDP)",
                               "remove fsdp_sharding_strategy and set parallelism_config_dp_shard_size / "
                               "parallelism_config_dp_replicate_size"),
    "FSDP_RESHARD_AFTER_FORWARD": (("true",), "every FSDP group reshards after its forward (FSDP2's default, "
                                   "ZeRO-3); keeping the weights gathered is not an option here",
                                   "remove fsdp_reshard_after_forward (or set it to true)"),
    "FSDP_AUTO_WRAP_POLICY": (("TRANSFORMER_BASED_WRAP",), "nd_parallel wraps one FSDP group per decoder layer "
                              "plus the root, which is TRANSFORMER_BASED_WRAP",
                              "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP or remove it"),
    "FSDP_BACKWARD_PREFETCH": (("BACKWARD_PRE",), "FSDP2 prefetches the next group's all-gather in backward "
                               "itself (BACKWARD_PRE); other FSDP1 policies do not exist there",
                               "remove fsdp_backward_prefetch"),
    "FSDP_STATE_DICT_TYPE": (("SHARDED_STATE_DICT",), "save_state writes a sharded DCP checkpoint that loads "
                             "under any layout (SHARDED_STATE_DICT)", "set fsdp_state_dict_type: "
                             "SHARDED_STATE_DICT; for full weights use accelerator.save_model or nd-parallel export"),
    "FSDP_FORWARD_PREFETCH": (("false",), "explicit forward prefetch is not implemented",
                              "set fsdp_forward_prefetch: false"),
    "FSDP_USE_ORIG_PARAMS": (("true",), "FSDP2 always keeps the original parameters (as DTensors)",
                             "set fsdp_use_orig_params: true or remove it"),
}
# Taken as they are: cpu_ram_efficient_loading / sync_module_states are how every rank gets equal weights. With
# cpu_ram_efficient_loading on (the launcher's default), transformers' from_pretrained expects Accelerate's FSDP
# preparation to broadcast rank 0's weights; nd_parallel broadcasts none, so launcher_env.adopt_launcher_env turns it
# off before the script loads (Accelerator() and build_device_mesh call it) and every rank reads the checkpoint (or
# only its slices, with plugin.from_pretrained). min_num_params only applies to SIZE_BASED_WRAP (refused above), the wrapped class is
# checked against the model at prepare (check_wrap_class).
_TAKEN = ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING", "FSDP_SYNC_MODULE_STATES", "FSDP_MIN_NUM_PARAMS",
          "FSDP_TRANSFORMER_CLS_TO_WRAP", "FSDP_ACTIVATION_CHECKPOINTING", "FSDP_OFFLOAD_PARAMS",
          "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD")
# fsdp_offload_params / fsdp_activation_checkpointing_offload: true switch on the memory options of the same meaning
# (config/memory.py); false leaves the config as it is.
_MEMORY = {"FSDP_OFFLOAD_PARAMS": "fsdp_offload_params", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "activation_offloading"}


def apply_fsdp_keys(config: ParallelismConfig, environ=None) -> ParallelismConfig:
    """``config`` with the launch file's fsdp_config applied; every key we cannot honour refused."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_FSDP", "").lower() not in _TRUE:
        return config
    for var, value in sorted(env.items()):
        if not var.startswith("FSDP_") or var in _TAKEN:
            continue
        if var not in _MATCH_OR_REFUSE:
            raise ConfigError(f"{var}={value!r} (fsdp_config key {_key(var)}) is not one nd_parallel knows, so it "
                              "could not take effect; remove it from the accelerate config file")
        matches, why, fix = _MATCH_OR_REFUSE[var]
        if value.strip().upper() not in {m.upper() for m in matches}:
            raise ConfigError(f"fsdp_config {_key(var)}: {value!r} cannot take effect: {why}; {fix}")
    if env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() in _TRUE and config.activation_checkpointing is None:
        # fsdp_activation_checkpointing: true (Accelerate's cp.yaml has it) = recompute each decoder layer
        config = dataclasses.replace(config, activation_checkpointing="full")
    for var, field in _MEMORY.items():
        if env.get(var, "false").strip().lower() in _TRUE:
            config = dataclasses.replace(config, **{field: True})
    return config


def check_wrap_class(model, environ=None) -> None:
    """fsdp_transformer_layer_cls_to_wrap must name the class nd_parallel wraps: the model's decoder layer."""
    env = os.environ if environ is None else environ
    wanted = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").strip()
    if not wanted or env.get("ACCELERATE_USE_FSDP", "").lower() not in _TRUE:
        return
    from nd_parallel.models import hf, peft

    layers = hf.decoder_layers(peft.base_of(model))
    names = sorted({type(layer).__name__ for layer in layers})
    if sorted(n.strip() for n in wanted.split(",")) != names:
        raise ConfigError(f"fsdp_config fsdp_transformer_layer_cls_to_wrap: {wanted!r} cannot take effect: "
                          f"nd_parallel wraps each decoder layer of the model ({', '.join(names) or 'none found'}) "
                          f"in its own FSDP group; set it to {','.join(names)} or remove it")


def _key(var: str) -> str:
    return "fsdp_" + var.removeprefix("FSDP_").lower()
