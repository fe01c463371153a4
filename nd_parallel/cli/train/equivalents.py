"""Axolotl keys whose meaning `nd-parallel train` reaches with its own means: attention (`attn_implementation` and
its deprecated aliases), `gradient_checkpointing_kwargs`, DeepSpeed ZeRO jsons, FSDP1's list form, and the keys an
Axolotl plugin listed in `plugins:` adds.

Each function takes the YAML's mapping and returns ``Mapped``: settings to apply, lines to print once (what was
mapped, what falls back), and refusals (each with its fix) for config.py to collect into its one message.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any

from nd_parallel.config import ParallelismConfig


@dataclass
class Mapped:
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def add(self, other: Mapped) -> Mapped:
        self.settings.update(other.settings)
        self.notes += other.notes
        self.refused += other.refused
        return self


def layout_field(*names: str) -> str | None:
    """The first of `names` that ParallelismConfig has (options other parts of nd_parallel may add)."""
    have = {f.name for f in dataclasses.fields(ParallelismConfig)}
    return next((n for n in names if n in have), None)


OFFLOAD_FIELDS = ("offload_params", "fsdp_offload_params", "cpu_offload")


def offload_setting(what: str) -> tuple[dict, str | None]:
    """({field: True}, None) where ParallelismConfig has a CPU-offload option, else ({}, refusal fix)."""
    name = layout_field(*OFFLOAD_FIELDS)
    if name:
        return {name: True}, None
    return {}, (f"{what}: CPU offload of the sharded parameters is not available in this nd_parallel; shard over "
                "more ranks (dp_shard_size: -1, or a larger dp_shard_size) or split the layers with "
                "pipeline_parallel_size")


# ---------------------------------------------------------------------------------------------- attention
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "xformers")
# Axolotl's deprecated boolean keys -> the attn_implementation they mean
ALIASES = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "flex_attention": "flex_attention",
           "eager_attention": "eager", "xformers_attention": "xformers", "sage_attention": "sage"}
# CUDA kernels that compute the same attention as SDPA: (python package, transformers' name)
_KERNELS = {"flash_attention_2": ("flash_attn", "flash_attention_2"),
            "flash_attention_3": ("flash_attn_interface", "flash_attention_3"),
            "xformers": ("xformers", None), "sage": ("sageattention", None), "flex_attention": ("torch", None)}


def attention(d: dict) -> Mapped:
    """Axolotl's attention choice -> the attn_implementation the ranks load the model with."""
    out = Mapped()
    chosen = {ALIASES[k]: k for k in ALIASES if d.get(k)}
    requested = d.get("attn_implementation")
    if requested is not None and not isinstance(requested, str):
        out.refused.append(f"attn_implementation={requested!r}: write one of {', '.join(ATTENTION)}")
        return out
    if requested is None and len(chosen) > 1:
        out.refused.append(f"{' and '.join(sorted(chosen.values()))} are all set: keep one attention key "
                           "(attn_implementation: sdpa | flash_attention_2 | ...)")
        return out
    if requested is None and chosen:
        requested = next(iter(chosen))
    if requested is None:
        return out
    hub_kernel = "/" in requested  # a kernels-hub name, e.g. kernels-community/vllm-flash-attn3
    if requested not in ATTENTION and requested != "sage" and not hub_kernel:
        out.refused.append(f"attn_implementation={requested!r}: use one of {', '.join(ATTENTION)}")
        return out
    import torch

    if requested in ("eager", "sdpa"):
        out.settings["attn_implementation"] = requested
        return out
    package, hf_name = _KERNELS.get(requested, ("kernels", requested))
    cuda = torch.cuda.is_available()
    if cuda and hf_name and importlib.util.find_spec(package) is not None:
        out.settings["attn_implementation"] = hf_name
        return out
    if cuda and requested == "flex_attention":
        out.settings["attn_implementation"] = "flex_attention"
        return out
    why = "no CUDA device" if not cuda else f"the {package!r} package is not installed"
    out.settings["attn_implementation"] = "sdpa"
    out.notes.append(f"attention: {requested} needs a CUDA kernel ({why}); using SDPA, the same attention")
    return out


def checkpointing_kwargs(value: Any) -> Mapped:
    """gradient_checkpointing_kwargs: nd_parallel checkpoints each decoder layer, non-reentrant."""
    out = Mapped()
    if value in (None, {}):
        return out
    if not isinstance(value, dict):
        out.refused.append(f"gradient_checkpointing_kwargs={value!r}: write a mapping, e.g. {{use_reentrant: false}}")
        return out
    for key, v in value.items():
        if key == "use_reentrant" and isinstance(v, bool):
            if v:
                out.notes.append("gradient_checkpointing_kwargs.use_reentrant=true: nd_parallel's checkpointing is "
                                 "non-reentrant; the recomputed forward and the gradients are the same")
        else:
            out.refused.append(f"gradient_checkpointing_kwargs.{key}={v!r}: only use_reentrant (true/false) is "
                               "read; drop it")
    return out


def selective_checkpointing(data: dict) -> Mapped:
    """Axolotl's selective_checkpointing (true, or {save: [ops], save_sliding_window, recompute_layer_types}): within
    each checkpointed layer, keep some ops' outputs instead of recomputing them. nd_parallel's selective mode keeps
    the matmul and attention outputs of each checkpointed layer. Recomputation gives the same values, so either
    choice trains the same numbers; only memory differs."""
    out, value = Mapped(), data.get("selective_checkpointing")
    if value in (None, False):
        return out
    if not (value is True or isinstance(value, dict)):
        out.refused.append(f"selective_checkpointing={value!r}: write true, or a mapping such as {{save: [attention]}}")
    elif not data.get("gradient_checkpointing"):
        out.notes.append("selective_checkpointing without gradient_checkpointing: it applies within checkpointed "
                         "layers (Axolotl's meaning), so nothing is checkpointed; set gradient_checkpointing: true")
    else:
        out.settings["activation_checkpointing"] = "selective"
        out.notes.append("selective_checkpointing: each checkpointed layer keeps its matmul and attention outputs "
                         "(activation_checkpointing: selective); the ops named in save are not chosen one by one. "
                         "Recomputation gives the same values, so training is the same; only memory differs")
    return out


# ---------------------------------------------------------------------------------------------- FSDP1 list
def fsdp_list(value: Any) -> Mapped:
    """Axolotl/accelerate's FSDP1 list form, e.g. [full_shard, auto_wrap, offload]."""
    out = Mapped()
    if value in (None, False, "", []):
        return out
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list):
        out.refused.append(f"fsdp={value!r}: write a list such as [full_shard, auto_wrap]")
        return out
    for item in items:
        if item in ("full_shard", "auto_wrap"):  # the decoder layer is the wrap unit, always
            continue
        if item == "offload":
            setting, why = offload_setting("fsdp: [..., offload]")
            out.settings.update(setting)
            if why:
                out.refused.append(why)
        else:
            fix = {"shard_grad_op": "ZeRO-2 keeps parameters gathered between forward and backward; nd_parallel "
                                    "reshards each layer (same math): use full_shard",
                   "hybrid_shard": "set dp_replicate_size and dp_shard_size instead (HSDP)",
                   "no_shard": "use dp_replicate_size (DDP) instead"}.get(item, "use full_shard, auto_wrap, offload")
            out.refused.append(f"fsdp: {item!r}: {fix}")
    return out


# ---------------------------------------------------------------------------------------------- DeepSpeed
# Axolotl's shipped deepspeed_configs/*.json: (ZeRO stage, offloads parameters, offloads optimizer states)
SHIPPED = {"zero1.json": (1, False, False), "zero1_torch_compile.json": (1, False, False),
           "zero2.json": (2, False, False), "zero2_torch_compile.json": (2, False, False),
           "zero3.json": (3, False, False), "zero3_bf16.json": (3, False, False),
           "zero3_bf16_cpuoffload_params.json": (3, True, False), "zero3_bf16_cpuoffload_all.json": (3, True, True)}
_DS_TUNING = {"overlap_comm", "contiguous_gradients", "sub_group_size", "reduce_bucket_size", "allgather_partitions",
              "allgather_bucket_size", "reduce_scatter", "round_robin_gradients", "max_live_parameters",
              "max_reuse_distance", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
              "stage3_max_live_parameters", "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save",
              "stage3_gather_16bit_weights_on_model_save", "offload_optimizer", "offload_param", "stage"}
_DS_TOP = {"zero_optimization", "bf16", "fp16", "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
           "train_micro_batch_size_per_gpu", "wall_clock_breakdown", "steps_per_print", "zero_allow_untested_optimizer",
           "zero_force_ds_cpu_optimizer", "compile"}


def _zero(path: str) -> tuple[tuple[int, bool, bool] | None, str | None]:
    """((stage, offload params, offload optimizer), None) of a ZeRO json, or (None, why it cannot be mapped)."""
    if not os.path.isfile(path):
        known = SHIPPED.get(os.path.basename(path))
        if known is None:
            return None, (f"{path} does not exist and is not one of Axolotl's deepspeed_configs "
                          f"({', '.join(sorted(SHIPPED))}); fix the path")
        return known, None
    try:
        with open(path, encoding="utf-8") as f:
            ds = json.load(f)
    except (OSError, ValueError) as err:
        return None, f"cannot read {path} as JSON ({err}); fix the file"
    zero = ds.get("zero_optimization") or {}
    extra = sorted(set(ds) - _DS_TOP) + [f"zero_optimization.{k}" for k in sorted(set(zero) - _DS_TUNING)]
    if extra:
        return None, (f"{path} sets {', '.join(extra)}, which nd_parallel has no equivalent for (the optimizer and "
                      "schedule come from the YAML's optimizer / lr_scheduler); remove them from the json")
    if (ds.get("fp16") or {}).get("enabled") is True:
        return None, f"{path} enables fp16, which needs loss scaling (not implemented); use bf16: true"
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        return None, f"{path}: zero_optimization.stage={stage!r}; use 1, 2 or 3"
    on_cpu = lambda k: (zero.get(k) or {}).get("device") in ("cpu", "nvme")  # noqa: E731
    return (stage, on_cpu("offload_param"), on_cpu("offload_optimizer")), None


def accelerator_config(d: dict) -> Mapped:
    """Axolotl's ``accelerator_config`` (transformers' AcceleratorConfig). ``gradient_accumulation_kwargs.
    sync_each_batch`` only chooses whether DDP skips its all-reduce on accumulation micro-batches: nd_parallel's
    FSDP2 / HSDP reduce every micro-batch's gradients (what ``true`` asks for) and the summed gradient is the same
    either way. The other keys change how batches are split or dispatched over the ranks, which nd_parallel decides
    itself (the global batch is the same under every layout): refused."""
    out, value = Mapped(), d.get("accelerator_config")
    if value in (None, {}):
        return out
    if not isinstance(value, dict):
        out.refused.append(f"accelerator_config={value!r}: write a mapping, e.g. {{gradient_accumulation_kwargs: "
                           "{sync_each_batch: true}}")
        return out
    for key, sub in value.items():
        kwargs = sub if key == "gradient_accumulation_kwargs" and isinstance(sub, dict) else None
        if kwargs is not None and set(kwargs) <= {"sync_each_batch"} and kwargs.get("sync_each_batch") in (
                None, True, False):
            if kwargs.get("sync_each_batch"):
                out.notes.append("accelerator_config.gradient_accumulation_kwargs.sync_each_batch: gradients are "
                                 "reduced on every micro-batch here (FSDP2's reduce-scatter), as it asks")
            continue
        out.refused.append(f"accelerator_config.{key}={sub!r}: nd_parallel splits and accumulates batches itself "
                           "(the same global batch under every layout); only gradient_accumulation_kwargs: "
                           "{sync_each_batch: true | false} is read: drop the rest")
    return out


def deepspeed(d: dict) -> Mapped:
    """deepspeed: <ZeRO json> -> FSDP2 sharding over the data-parallel ranks (ZeRO-1/2/3 all train the same math
    as one process; FSDP2 also shards the parameters, which ZeRO-1/2 keep whole: less memory, same numbers)."""
    out = Mapped()
    value = d.get("deepspeed")
    if value in (None, ""):
        return out
    equivalent = "dp_shard_size: -1 (FSDP2 over every data-parallel rank, ZeRO-3's equivalent)"
    if not isinstance(value, str):
        out.refused.append(f"deepspeed={value!r}: give the path of a ZeRO json, or drop it and set {equivalent}")
        return out
    if d.get("fsdp") or d.get("fsdp_config"):
        out.refused.append("deepspeed and fsdp/fsdp_config are both set: keep one (Axolotl refuses both too)")
        return out
    zero, why = _zero(value)
    if zero is None:
        out.refused.append(f"deepspeed={value!r}: {why}; or drop it and set {equivalent}")
        return out
    stage, params, optim = zero
    if stage and not any(str(k).startswith("dp_") for k in d):
        out.settings["dp_shard_size"] = -1
    if params or optim:
        setting, why = offload_setting(f"deepspeed={value!r} offloads to CPU")
        out.settings.update(setting)
        if why:
            out.refused.append(why)
    out.notes.append(f"deepspeed {os.path.basename(value)}: ZeRO-{stage} mapped to FSDP2 sharding over the "
                     f"data-parallel ranks{' with CPU offload' if params or optim else ''}; the json's 'auto' "
                     "values come from the YAML")
    return out


# ---------------------------------------------------------------------------------------------- plugins
_GPU_ONLY = "a CUDA/Triton kernel: on CPU ranks training runs without it (the same math)"
_LIGER = "Liger's Triton kernels need a GPU: training runs without them (the same math)"
# Axolotl 0.19's plugins: their YAML keys and what nd-parallel train does with each when set (used when Axolotl
# itself is not installed; with it, the plugin's own get_input_args() schema lists the keys).
PLUGINS = {
    "axolotl.integrations.liger.LigerPlugin": dict.fromkeys(
        ("liger_rope", "liger_rms_norm", "liger_rms_norm_gated", "liger_layer_norm", "liger_swiglu",
         "liger_glu_activation", "liger_cross_entropy", "liger_fused_linear_cross_entropy",
         "liger_use_token_scaling"), _LIGER),
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": {"cut_cross_entropy": _GPU_ONLY},
    "axolotl.integrations.kernels.KernelsPlugin": dict.fromkeys(
        ("use_scattermoe", "use_sonicmoe", "expert_backend", "moe_grouped_backend", "moe_bnb_fast",
         "moe_dequant_chunk_size"), _GPU_ONLY),
    "axolotl.integrations.expert_parallel.ExpertParallelPlugin": dict.fromkeys(
        ("expert_parallel_size", "expert_parallel_backend", "expert_parallel_num_nvl_bytes",
         "expert_parallel_num_rdma_bytes", "expert_parallel_token_capacity",
         "expert_parallel_fallback_on_unsupported"), "DeepEP communication tuning: nd_parallel moves the tokens "
                                                     "with its own all-to-all"),
    "axolotl.integrations.swanlab.SwanLabPlugin": {},  # swanlab_* are loggers (keys.LOGGING_PREFIXES)
    "axolotl.integrations.diffusion.DiffusionPlugin": {
        "diffusion": "masked-diffusion training of the model (cli/train/diffusion.py)"},
    "axolotl.integrations.llm_compressor.LLMCompressorPlugin": {
        "llmcompressor": "sparse fine-tuning: the recipe's ConstantPruningModifier keeps the targeted parameters' "
                         "zeros (cli/train/sparsity.py)"},
}


def plugin_keys(plugins: Any) -> dict[str, str]:
    """key -> what is done with it, for every key the YAML's `plugins:` make known."""
    known: dict[str, str] = {}
    for name in plugins or []:
        keys = _installed_plugin_keys(name) if isinstance(name, str) else None
        table = PLUGINS.get(name, {})
        for key in keys or table:
            known[key] = table.get(key, "an Axolotl plugin key: used by that plugin under Axolotl, not here")
    return known


def _installed_plugin_keys(name: str) -> list[str] | None:
    """The plugin's own input schema when Axolotl is importable (None otherwise)."""
    module, _, cls = name.rpartition(".")
    try:
        plugin = getattr(importlib.import_module(module), cls)()
        schema_path = plugin.get_input_args()
        if not schema_path:
            return []
        smod, _, scls = schema_path.rpartition(".")
        return list(getattr(importlib.import_module(smod), scls).model_fields)
    except Exception:  # Axolotl not installed (the common case), or a plugin we cannot build: use the table
        return None


EP_ALONE = ("expert_parallel_size without dp_shard_size: the experts are split over expert_parallel_size ranks and "
            "the other weights are FSDP2-sharded over the data-parallel ranks (dp_shard_size: -1, where Axolotl "
            "replicates them): the same training")


OWN_PLUGIN = "nd_parallel.plugins.axolotl.NDParallelAxolotlPlugin"  # what nd-parallel train is already


def plugins(d: dict, keys: dict[str, str]) -> Mapped:
    """What the plugin keys set in `d` do here: expert_parallel_size -> ep_size (where nd_parallel has it);
    kernel switches accepted with one line each. A plugin outside ``PLUGINS`` (third-party ones) would change
    training under Axolotl: refused, never dropped."""
    out = Mapped()
    for name in d.get("plugins") or []:
        if not isinstance(name, str):
            out.refused.append(f"plugins: {name!r}; list plugin class paths (strings)")
        elif name not in PLUGINS and name != OWN_PLUGIN:
            out.refused.append(f"plugins: {name!r} is not run by nd-parallel train (under Axolotl it may change what "
                               f"is trained); remove it, or run the YAML with Axolotl and the nd_parallel plugin "
                               f"(docs/axolotl.md). Known here: {', '.join(sorted(PLUGINS))}")
    for key, why in keys.items():
        value = d.get(key)
        if value in (None, False, 0, "", []):
            continue
        if key == "expert_parallel_size":
            name = layout_field("ep_size")
            if name:
                out.settings[name] = value
            elif value != 1:
                out.refused.append(f"expert_parallel_size={value!r}: expert parallelism is not supported yet by "
                                   "this nd_parallel; drop it (experts are sharded with the layer by FSDP2/TP)")
            continue
        if key.startswith("liger_") and _liger_available():
            why = "applied with liger-kernel on the CUDA ranks"
        out.notes.append(f"{key}: {why}")
    return out


def _liger_available() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None
