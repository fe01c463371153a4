"""`nd-parallel train`'s YAML: Axolotl's keys with Axolotl's meanings, plus the parallel sizes (ours and Axolotl's).

`load_train_config` reads the file once and sorts every key: implemented (a TrainConfig field), a logger/hub key
or an Axolotl key left at its default (accepted, listed once in `TrainConfig.unused`), or a key that would change
training but is not implemented, a bad fsdp_config entry, or a typo: all of those stop the run together, in one
ConfigError that gives each key's alternative (keys.py). No model or data file is opened here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nd_parallel.config import PARALLEL_KEYS, RUN_OPTIONS, ConfigError, ParallelismConfig
from nd_parallel.config.sources import yaml_number

from . import equivalents, grpo, keys
from .data.sources import DatasetSpec, dataset_specs, suggest
from .data.templates import template_problem
from .equivalents import ALIASES, Mapped
from .extras import AxolotlExtras, extra_refusals, extras_notes, model_kind_refusals
from .keys import REFUSED, UNREAD, is_default, is_logging, map_fsdp, map_memory_keys, value_refusals, wrap_classes
from .preference import PreferenceOptions, rl_refusals
from .schema import AXOLOTL_DEFAULTS
from .streaming import StreamingOptions


@dataclass(kw_only=True)
class TrainConfig(PreferenceOptions, AxolotlExtras, StreamingOptions):
    """A training run read from YAML. Precedence of the layout keys: CLI > YAML > env > defaults."""

    # --- model
    base_model: str
    """Local directory of a Hugging Face causal-LM checkpoint. Required."""
    base_model_config: str | None = None
    """Directory whose config.json is used instead of base_model's. Default: base_model."""
    tokenizer_config: str | None = None
    """Directory of the tokenizer. Default: base_model (byte-level ids when it has no tokenizer files)."""
    model_config: dict | None = None
    """Config attributes to override when the model loads (Axolotl's model_config, e.g. {output_router_logits:
    true}: MoE models add their router's auxiliary loss). Default none."""
    model_type: str | None = None
    """Axolotl's model class: *ForCausalLM, an image-text one with processor_type, or reward.py's heads."""
    tokenizer_type: str | None = None
    """Axolotl's tokenizer class name; the tokenizer is loaded with AutoTokenizer."""
    trust_remote_code: bool | None = None
    """Passed to from_pretrained only when given."""
    special_tokens: dict[str, str] = field(default_factory=dict)
    """e.g. {pad_token: "<pad>"}: set on the tokenizer; new ones grow the embeddings."""
    tokens: list[str] = field(default_factory=list)
    """Extra tokens added to the tokenizer (the embeddings grow to fit)."""
    chat_template: str | None = None
    """A named template (data/templates.py: chatml, llama3, gemma3, phi_3, ...), "tokenizer_default" (default: the
    tokenizer's own), "tokenizer_default_fallback_<name>" or "jinja" (chat_template_jinja)."""
    chat_template_jinja: str | None = None
    """A Jinja chat template, or the path of a .jinja file, with chat_template: jinja."""
    eot_tokens: list[str] | None = None
    """chat_template: the end-of-turn tokens train_on_eos trains (Axolotl's eot_tokens). Default: the eos_token."""
    attn_implementation: str | None = None
    """Attention the model is loaded with: eager, sdpa, or a CUDA kernel where one is installed (equivalents.py
    resolves Axolotl's attn_implementation and its older boolean keys). Default: the model's own choice."""
    # --- data
    datasets: list[DatasetSpec]
    """Data sources (sources.DatasetSpec); `dataset_path: FILE` is shorthand for one completion source."""
    val_set_size: float = 0.0
    """Held-out share (< 1) or number of samples (>= 1) for evaluation. Default 0."""
    dataset_prepared_path: str | None = None
    """Cache of the tokenized data (reused while the data, tokenizer and settings are the same). Default: none."""
    sequence_len: int = 512
    """Tokens per sample; longer alpaca/chat samples are dropped, completion texts cut. Default 512."""
    pad_to_sequence_len: bool = False
    """Pad every batch to sequence_len (else to its longest sample). Default false."""
    sample_packing: bool = False
    """Pack several samples into each sequence_len row, position ids restarting per sample. Default false."""
    eval_sample_packing: bool | None = None
    """Packing of the evaluation split. Default: as sample_packing."""
    train_on_inputs: bool = False
    """alpaca/chat_template: train on the prompt too. Default false."""
    min_sample_len: int | None = None
    """Drop samples with fewer tokens than this (Axolotl's min_sample_len). Default 2."""
    shuffle_merged_datasets: bool = True
    """Shuffle the mix of several datasets (with seed). Default true."""
    # --- training
    micro_batch_size: int = 1
    """Samples per data-parallel rank per forward pass. Default 1."""
    eval_batch_size: int | None = None
    """Evaluation samples per data-parallel rank. Default micro_batch_size."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Default 1."""
    num_epochs: float = 1.0
    """Passes over the data (when max_steps is not set). Default 1."""
    max_steps: int | None = None
    """Optimizer steps; overrides num_epochs. Default None."""
    optimizer: str = "adamw_torch"
    """adamw_torch or adamw_torch_fused. Default adamw_torch."""
    learning_rate: float = 1e-4
    """Peak learning rate. Default 1e-4."""
    lr_scheduler: str = "cosine"
    """One of keys.SCHEDULERS. Default cosine."""
    warmup_steps: int | float | None = None
    """Linear warm-up steps; below 1, a share of the steps (as the Trainer and Axolotl's examples read it); 0 default"""
    warmup_ratio: float | None = None
    """Warm-up as a share of the steps (instead of warmup_steps)."""
    weight_decay: float = 0.0
    """AdamW weight decay. Default 0."""
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_epsilon: float | None = None
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this. Default 1.0."""
    seed: int = 42
    """Seed for the model's init, the data order and the split. Default 42."""
    # --- precision and memory
    bf16: bool | str = "auto"
    """true, false or "auto" (bf16 on GPUs that support it, fp32 on CPU ranks). Default auto."""
    fp16: bool = False
    """fp16 compute, fp32 master weights, dynamic loss scaling (bf16: true wins; float16: true reads as this)."""
    tf32: bool | str = False
    """Allow TF32 matmuls on CUDA; no effect on CPU."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward (activation_checkpointing: full). Default false."""
    gradient_checkpointing_kwargs: dict | None = None
    """Axolotl's {use_reentrant: ...}: accepted (the recompute is non-reentrant either way)."""
    unfrozen_parameters: list[str] | None = None
    """Regexes of parameter names to train; every other parameter is frozen (full fine-tuning only)."""
    loss_watchdog_threshold: float | None = None
    """Stop training when the loss stays above this for loss_watchdog_patience logged steps. Default off."""
    loss_watchdog_patience: int | None = None
    """Consecutive steps above loss_watchdog_threshold before stopping. Default 3."""
    liger: dict = field(default_factory=dict)
    """The Liger plugin's liger_* switches, applied on CUDA ranks where liger-kernel is installed."""
    # --- adapter
    adapter: str | None = None
    """"lora", "qlora" (with load_in_4bit) or none (full fine-tuning)."""
    load_in_4bit: bool = False
    """Quantize the base to 4 bits as it loads (bitsandbytes NF4, double quantization; adapter: qlora)."""
    load_in_8bit: bool = False
    """Quantize the base to 8 bits as it loads (bitsandbytes LLM.int8; adapter: lora). Not with tensor parallelism."""
    bnb_config_kwargs: dict | None = None
    """Overrides of the 4-bit settings (keys.BNB_4BIT): quant type, double quant, compute dtype (default: bf16 with
    bf16: true, else fp32), quant storage."""
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | str | None = None
    """Module names to adapt (default: peft's choice for the model family)."""
    lora_target_linear: bool = False
    """Adapt every linear layer but the LM head (peft's "all-linear")."""
    lora_modules_to_save: list[str] | None = None
    lora_model_dir: str | None = None
    """Start from this saved adapter (trainable)."""
    # --- output
    output_dir: str = "./model-out"
    """Checkpoints, the final model or adapter, the tokenizer and train_log.jsonl. Default ./model-out."""
    logging_steps: int | None = None
    """Print a line every this many steps (train_log.jsonl has every step). Default 1."""
    eval_steps: int | float | None = None
    evals_per_epoch: int | None = None
    eval_strategy: str | None = None
    save_steps: int | float | None = None
    saves_per_epoch: int | None = None
    save_strategy: str | None = None
    save_total_limit: int | None = None
    resume_from_checkpoint: str | None = None
    """A checkpoint-N folder written by an earlier run (sharded; loads under another layout too), or "auto": the latest
    complete checkpoint-N under output_dir, a fresh start when there is none (nd_parallel/fault/resume.py)."""
    trainer_callbacks: list[dict] = field(default_factory=list)
    """Extra ``transformers.TrainerCallback`` classes, built on every rank: ``module:Class`` or ``{class: module:Class,
    args: {...}}`` (callbacks.callback_specs). Default none."""
    # --- layout
    parallel: ParallelismConfig = field(default_factory=ParallelismConfig)
    """The layout: built from the parallel keys (PARALLEL_KEYS, fsdp_config) of the same file."""
    layout: str | None = None
    """"auto": the planner's top layout for the ranks launched (cli/plan.py, auto_train_layout). Default None."""
    lr_scaling: str | None = None
    """"linear" or "sqrt": scale learning_rate from base_batch_size to the global batch. Default None = as given."""
    base_batch_size: int | None = None
    """The global batch learning_rate was tuned at (with lr_scaling). Default None."""
    unused: list[str] = field(default_factory=list)
    """Keys accepted but not acted on (loggers, hubs, Axolotl keys at their default); reported once."""
    notes: list[str] = field(default_factory=list)
    """One line per Axolotl key mapped or falling back (attention, deepspeed, plugins, ...); reported once."""
    fsdp_wrap_classes: list[str] = field(default_factory=list)  # fsdp_config's, for job.check_local_model


_NOT_KEYS = {"parallel", "unused", "datasets", "notes", "liger", "attn_implementation", "fsdp_wrap_classes",
             "import_dirs"}
_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} - _NOT_KEYS
# MAPPED: read by equivalents.py (keys.KERNEL_KEYS: fused kernels of the same computation, one line each)
MAPPED = {"attn_implementation", "deepspeed", *ALIASES, "plugins", "fsdp", *keys.KERNEL_KEYS, "bfloat16", "float16",
          "torch_compile_mode", "gemma4_hybrid_attn_impl", "accelerator_config", "selective_checkpointing"}
EXTRA_PARALLEL = {"sequence_parallel_degree": "cp_size", "fsdp": None, "fsdp_version": None, "fsdp_config": None,
                  "tiled_mlp_use_original_mlp": None}
TRAIN_KEYS = frozenset(_FIELDS | {"datasets", "dataset_path"})
# key -> (type, bound, how a value compares with the bound)
_CHECKS = {"sequence_len": (int, 2, ">="), "micro_batch_size": (int, 1, ">="), "max_steps": (int, 1, ">="),
           "gradient_accumulation_steps": (int, 1, ">="), "warmup_steps": (float, 0, ">="), "seed": (int, 0, ">="),
           "learning_rate": (float, 0, ">"), "weight_decay": (float, 0, ">="), "max_grad_norm": (float, 0, ">"),
           "base_batch_size": (int, 1, ">="), "num_epochs": (float, 0, ">"), "val_set_size": (float, 0, ">="),
           "lora_r": (int, 1, ">="), "lora_alpha": (float, 0, ">"), "lora_dropout": (float, 0, ">="),
           "eval_batch_size": (int, 1, ">="), "logging_steps": (int, 1, ">="), "save_total_limit": (int, 1, ">="),
           "evals_per_epoch": (int, 0, ">="), "saves_per_epoch": (int, 1, ">="), "warmup_ratio": (float, 0, ">="),
           "eval_steps": (float, 0, ">"), "save_steps": (float, 0, ">"), "adam_beta1": (float, 0, ">="),
           "adam_beta2": (float, 0, ">="), "adam_epsilon": (float, 0, ">"), "min_sample_len": (int, 1, ">="),
           "loss_watchdog_threshold": (float, 0, ">"), "loss_watchdog_patience": (int, 1, ">=")}
_BOOLS = ("pad_to_sequence_len", "sample_packing", "train_on_inputs", "gradient_checkpointing", "lora_target_linear",
          "shuffle_merged_datasets", "fp16", "load_in_4bit", "load_in_8bit")


def read_yaml_mapping(path: str | os.PathLike) -> dict:
    """The top-level mapping of a YAML file, read with safe_load; errors name the file and the fix."""
    from nd_parallel.config.sources import safe_load_yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    data = safe_load_yaml(text, str(path))
    if not isinstance(data, dict):
        got = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"{path} is {got}; expected a mapping of keys such as 'base_model: path/to/model'")
    return data


def _check_value(key: str, value: Any) -> Any:
    kind, bound, op = _CHECKS[key]
    if kind is float:
        value = yaml_number(value)
    number = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if not number or value < bound or (op == ">" and value == bound):
        raise ConfigError(f"{key}={value!r} must be {'an integer' if kind is int else 'a number'} {op} {bound}")
    if key in ("eval_steps", "save_steps", "warmup_steps"):  # steps, or (< 1) a share of all steps, as in the Trainer
        return int(value) if value >= 1 else float(value)
    return kind(value)


def _sort_keys(path, data: dict, plugin_keys: dict) -> tuple[dict, list[str], list[str]]:
    """(keys we act on, unused keys, refusal lines) -- see the module docstring."""
    ours, unused, refused = {}, [], []
    known = TRAIN_KEYS | PARALLEL_KEYS | set(EXTRA_PARALLEL) | MAPPED | set(plugin_keys)
    for key, value in data.items():
        key = str(key)
        if key in known:
            ours[key] = value
        elif is_logging(key) or key in UNREAD:  # UNREAD: each printed with its line (keys.py)
            unused.append(key)
        elif key in REFUSED:
            if is_default(key, value, AXOLOTL_DEFAULTS):
                unused.append(key)
            else:
                refused.append(f"{key}={value!r}: {REFUSED[key]}")
        elif key in AXOLOTL_DEFAULTS:
            if is_default(key, value, AXOLOTL_DEFAULTS):
                unused.append(key)
            else:
                refused.append(f"{key}={value!r}: not implemented by nd-parallel train; drop it, or run the YAML "
                               "with Axolotl and the nd_parallel plugin (docs/axolotl.md)")
        elif value is None:  # a key Axolotl 0.19 does not have, left empty
            unused.append(key)
        else:
            owner = next((p for p, keys in equivalents.PLUGINS.items() if key in keys), None)
            hint = f"it belongs to Axolotl's plugin {owner}: list it under plugins:" if owner else suggest(key, known)
            refused.append(f"unknown key {key!r} in {path}; {hint}")
    return ours, unused, refused


def _layout(path, d: dict, environ, mapped: Mapped) -> tuple[ParallelismConfig | None, list[str]]:
    yaml_layout = {k: v for k, v in d.items() if k in PARALLEL_KEYS}
    if d.get("sequence_parallel_degree") not in (None, 1):  # Axolotl's older name of context_parallel_size
        yaml_layout.setdefault("context_parallel_size", d["sequence_parallel_degree"])
    settings, refused = map_fsdp(d.get("fsdp_version"), d.get("fsdp_config"))
    if settings.pop("gradient_checkpointing", None):
        d["gradient_checkpointing"] = True
    for key, value in {**mapped.settings, **settings}.items():
        if key in PARALLEL_KEYS or key in {f.name for f in dataclasses.fields(ParallelismConfig)}:
            yaml_layout.setdefault(key, value)
    sharded = d.get("fsdp") or d.get("fsdp_config") or d.get("fsdp_version")
    if (sharded or (yaml_layout.get("ep_size") or 1) != 1) and not any(k.startswith("dp_") for k in yaml_layout):
        yaml_layout["dp_shard_size"] = -1  # FSDP (or Axolotl's EP alone) and no size: shard over the ranks left over
        mapped.notes += [] if sharded else [equivalents.EP_ALONE]
    refused = [f"{k}: {why}" for k, why in refused]
    try:  # One precedence rule (nd_parallel/config): YAML overrides the PARALLELISM_CONFIG_* variables.
        layout = ParallelismConfig.merge(ParallelismConfig.env_overrides(environ), yaml_layout, source=str(path))
    except (ConfigError, ValueError, TypeError) as err:
        return None, [*refused, str(err)]
    if d.get("gradient_checkpointing") is True and layout.activation_checkpointing is None:
        layout = dataclasses.replace(layout, activation_checkpointing="full")
    return layout, refused


def _types(d: dict) -> list[str]:
    out = []
    for key in ("base_model", "output_dir", "lr_scheduler", "base_model_config", "tokenizer_config"):
        if key in d and d[key] is not None and not isinstance(d[key], str):
            out.append(f"{key}={d[key]!r} is a {type(d[key]).__name__}; write a string")
    for key in _BOOLS:
        if d.get(key) is not None and not isinstance(d[key], bool):
            out.append(f"{key}={d[key]!r}; use true or false")
    if d.get("model_config") is not None and not isinstance(d["model_config"], dict):
        out.append(f"model_config={d['model_config']!r}; write a mapping of config attributes")
    for key in ("unfrozen_parameters", "eot_tokens", "tokens"):  # tokens as a mapping: old examples (Axolotl refuses)
        if d.get(key) is not None and not (isinstance(d[key], list) and all(isinstance(x, str) for x in d[key])):
            hint = " of new tokens (pad/bos/eos/unk tokens go under special_tokens:)" * (key == "tokens")
            out.append(f"{key}={d[key]!r}; write a list of strings{hint}")
    for pattern in d.get("unfrozen_parameters") or []:
        if re.match(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$", str(pattern)):  # Axolotl's "name[start:end]" rows
            out.append(f"unfrozen_parameters: {pattern!r} unfreezes rows of a parameter (through gradient hooks, "
                       "which sharded parameters do not take); unfreeze the whole parameter (drop the [..] range)")
            continue
        try:
            re.compile(str(pattern))
        except re.error as err:
            out.append(f"unfrozen_parameters: {pattern!r} is not a regular expression ({err}); fix it")
    return out + [p for p in [template_problem(d.get("chat_template"), bool(d.get("processor_type")))] if p]


def _mapped(data: dict, plugin_keys: dict) -> Mapped:
    out = Mapped().add(equivalents.attention(data)).add(equivalents.checkpointing_kwargs(
        data.get("gradient_checkpointing_kwargs"))).add(equivalents.fsdp_list(data.get("fsdp")))
    out.add(equivalents.deepspeed(data)).add(equivalents.plugins(data, plugin_keys)).add(
        equivalents.accelerator_config(data)).add(equivalents.selective_checkpointing(data))
    for key in keys.KERNEL_KEYS:
        if data.get(key):
            out.notes.append(f"{key}: fused CUDA kernels of the same computation; not applied by nd-parallel train")
    if data.get("torch_compile_mode"):  # inductor's tuning of the same graphs
        out.notes.append(f"torch_compile_mode={data['torch_compile_mode']!r}: not passed on; with torch_compile the "
                         "layers compile in inductor's default mode (the same math, kernels tuned less)")
    if data.get("gemma4_hybrid_attn_impl"):  # FA2 on sliding layers, SDPA on global ones: one attention, SDPA
        out.settings["attn_implementation"] = "sdpa"
        out.notes.append("gemma4_hybrid_attn_impl: every layer runs SDPA (the hybrid only swaps kernels)")
    out.notes += extras_notes(data) + [f"{k}: {why}" for k, why in UNREAD.items() if data.get(k) is not None]
    return out


def load_train_config(path: str | os.PathLike, environ=None) -> TrainConfig:
    """Parse and check a training YAML (no file of the model or data is opened yet). Every refused key, value,
    fsdp/deepspeed setting and datasets entry is collected into one ConfigError, each with its fix."""
    data = read_yaml_mapping(path)
    refused = []
    if data.get("auto_resume_from_checkpoints") is not None:  # Axolotl's switch for what "auto" does here
        if not isinstance(data["auto_resume_from_checkpoints"], bool):
            refused.append(f"auto_resume_from_checkpoints={data['auto_resume_from_checkpoints']!r}; use true or false")
        elif data.pop("auto_resume_from_checkpoints") and data.get("resume_from_checkpoint") is None:
            data["resume_from_checkpoint"] = "auto"
    for name, alias in (("overrides_of_model_kwargs", "model_kwargs"), ("overrides_of_model_config", "model_config")):
        if name in data:  # Axolotl's field names of its model_kwargs / model_config aliases (it reads both)
            refused += [f"{name} and {alias} both set: keep one (the same setting)"] if alias in data else []
            data.setdefault(alias, data.pop(name))
    plugin_keys = equivalents.plugin_keys(data.get("plugins"))
    d, unused, sorted_out = _sort_keys(path, data, plugin_keys)
    refused += sorted_out + extra_refusals(d) + map_memory_keys(d) + value_refusals(d) + _types(d)
    mapped = _mapped(data, plugin_keys)
    refused += mapped.refused
    if "base_model" not in d:
        refused.append("base_model is required: the local directory of a Hugging Face checkpoint (config.json + "
                       "*.safetensors), e.g. 'base_model: runs/tiny/model'")
    if d.get("layout", "auto") != "auto" or d.get("lr_scaling", "linear") not in ("linear", "sqrt"):
        refused.append(f"layout={d.get('layout')!r} / lr_scaling={d.get('lr_scaling')!r}; write 'layout: auto' (or "
                       "leave it out) and 'lr_scaling: linear' or 'sqrt'")
    if d.get("layout") == "auto" and set(d) & (PARALLEL_KEYS - {"pp_backend", "cp_backend", "tp_plan", *RUN_OPTIONS}):
        refused.append(f"layout: auto chooses the layout, but the file also sets "
                       f"{', '.join(sorted(set(d) & PARALLEL_KEYS))}; remove those keys or 'layout: auto'")
    layout, layout_refused = _layout(path, d, environ, mapped)
    refused += layout_refused + rl_refusals(d, layout, path) + model_kind_refusals(d, layout)
    streamed = data.get("pretraining_dataset") and d.get("datasets") is None  # refused above with its own fix
    specs = dataset_specs(path, d.get("datasets"), d.get("dataset_path"), [] if streamed else refused,
                          transforms=d.get("rl") in grpo.RL)
    if d.get("test_datasets"):  # test_datasets' entries, checked like datasets' (their messages name them)
        problems: list[str] = []
        d["test_datasets"] = dataset_specs(path, d["test_datasets"], None, problems)
        refused += [p.replace("datasets[", "test_datasets[") for p in problems]
    train = {k: v for k, v in d.items() if k in _FIELDS and v is not None}
    for key in _CHECKS:
        if train.get(key) is not None:
            try:
                train[key] = _check_value(key, train[key])
            except ConfigError as err:
                refused.append(str(err))
    if refused:
        count = sum(line.count("\n  - ") + 1 for line in refused)
        raise ConfigError(f"{path}: {count} setting(s) cannot be used by nd-parallel train:\n  - "
                          + "\n  - ".join(refused))
    for key in ("base_model", "base_model_config", "tokenizer_config", "lora_model_dir", "output_dir",
                "dataset_prepared_path", "resume_from_checkpoint"):
        if isinstance(train.get(key), str) and not (key == "resume_from_checkpoint" and train[key] == "auto"):
            # relative paths start at the working directory, as in Axolotl
            train[key] = os.path.abspath(os.path.expanduser(train[key]))
    if "trainer_callbacks" in train:
        from .callbacks import callback_specs

        train["trainer_callbacks"] = callback_specs(path, train["trainer_callbacks"])
    liger = {k: v for k, v in data.items() if k.startswith("liger_") and k in plugin_keys and v}
    return TrainConfig(**train, datasets=specs, parallel=layout, unused=sorted(set(unused)), notes=mapped.notes,
                       attn_implementation=mapped.settings.get("attn_implementation"), liger=liger,
                       fsdp_wrap_classes=wrap_classes(d.get("fsdp_config")), import_dirs=d.get("import_dirs", []))
