"""`nd-parallel train`'s YAML: Axolotl's keys with Axolotl's meanings, plus the parallel sizes (ours and Axolotl's).

`load_train_config` reads the file once and sorts every key: implemented (a TrainConfig field), a logger/hub key
or an Axolotl key left at its default (accepted, listed once in `TrainConfig.unused`), or a key that would change
training but is not implemented, a bad fsdp_config entry, or a typo: all of those stop the run together, in one
ConfigError that gives each key's alternative (keys.py). No model or data file is opened here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nd_parallel.config import PARALLEL_KEYS, RUN_OPTIONS, ConfigError, ParallelismConfig

from .data.sources import DatasetSpec, dataset_specs, suggest
from .keys import REFUSED, is_default, is_logging, map_fsdp, map_memory_keys, value_refusals
from .schema import AXOLOTL_DEFAULTS


@dataclass(kw_only=True)
class TrainConfig:
    """A training run read from YAML. Precedence of the layout keys: CLI > YAML > env > defaults."""

    # --- model
    base_model: str
    """Local directory of a Hugging Face causal-LM checkpoint. Required."""
    base_model_config: str | None = None
    """Directory whose config.json is used instead of base_model's. Default: base_model."""
    tokenizer_config: str | None = None
    """Directory of the tokenizer. Default: base_model (byte-level ids when it has no tokenizer files)."""
    model_type: str | None = None
    """Axolotl's model class name; any *ForCausalLM (the checkpoint's own class is loaded)."""
    tokenizer_type: str | None = None
    """Axolotl's tokenizer class name; the tokenizer is loaded with AutoTokenizer."""
    trust_remote_code: bool | None = None
    """Passed to from_pretrained only when given."""
    special_tokens: dict[str, str] = field(default_factory=dict)
    """e.g. {pad_token: "<pad>"}: set on the tokenizer; new ones grow the embeddings."""
    tokens: list[str] = field(default_factory=list)
    """Extra tokens added to the tokenizer (the embeddings grow to fit)."""
    chat_template: str | None = None
    """"tokenizer_default" (default: the tokenizer's own) or "jinja" (chat_template_jinja)."""
    chat_template_jinja: str | None = None
    """A Jinja chat template, with chat_template: jinja."""
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
    warmup_steps: int | None = None
    """Linear warm-up steps. Default 0."""
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
    """fp16 is refused (use bf16)."""
    tf32: bool | str = False
    """Allow TF32 matmuls on CUDA; no effect on CPU."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward (activation_checkpointing: full). Default false."""
    # --- adapter
    adapter: str | None = None
    """"lora", "qlora" (with load_in_4bit) or none (full fine-tuning)."""
    load_in_4bit: bool = False
    """Quantize the base to 4 bits as it loads (bitsandbytes NF4, double quantization; adapter: qlora)."""
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


_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} - {"parallel", "unused", "datasets"}
EXTRA_PARALLEL = {"sequence_parallel_degree": "cp_size", "fsdp": None, "fsdp_version": None, "fsdp_config": None,
                  "tiled_mlp_use_original_mlp": None}
TRAIN_KEYS = frozenset(_FIELDS | {"datasets", "dataset_path"})
# key -> (type, bound, how a value compares with the bound)
_CHECKS = {"sequence_len": (int, 2, ">="), "micro_batch_size": (int, 1, ">="), "max_steps": (int, 1, ">="),
           "gradient_accumulation_steps": (int, 1, ">="), "warmup_steps": (int, 0, ">="), "seed": (int, 0, ">="),
           "learning_rate": (float, 0, ">"), "weight_decay": (float, 0, ">="), "max_grad_norm": (float, 0, ">"),
           "base_batch_size": (int, 1, ">="), "num_epochs": (float, 0, ">"), "val_set_size": (float, 0, ">="),
           "lora_r": (int, 1, ">="), "lora_alpha": (float, 0, ">"), "lora_dropout": (float, 0, ">="),
           "eval_batch_size": (int, 1, ">="), "logging_steps": (int, 1, ">="), "save_total_limit": (int, 1, ">="),
           "evals_per_epoch": (int, 1, ">="), "saves_per_epoch": (int, 1, ">="), "warmup_ratio": (float, 0, ">="),
           "eval_steps": (float, 0, ">"), "save_steps": (float, 0, ">"), "adam_beta1": (float, 0, ">="),
           "adam_beta2": (float, 0, ">="), "adam_epsilon": (float, 0, ">")}
_BOOLS = ("pad_to_sequence_len", "sample_packing", "train_on_inputs", "gradient_checkpointing", "lora_target_linear",
          "shuffle_merged_datasets", "fp16", "load_in_4bit")


def read_yaml_mapping(path: str | os.PathLike) -> dict:
    """The top-level mapping of a YAML file, read with safe_load; errors name the file and the fix."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    try:
        data = yaml.safe_load(text)  # safe_load only: reading a config must never run code
    except yaml.constructor.ConstructorError as err:
        mark = err.problem_mark
        raise ConfigError(f"{path}, line {mark.line + 1}: {err.problem}; only plain YAML values are allowed "
                          "(numbers, strings, lists, mappings): remove the tag") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: malformed YAML: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(data, dict):
        got = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"{path} is {got}; expected a mapping of keys such as 'base_model: path/to/model'")
    return data


def _check_value(path, key: str, value: Any) -> Any:
    kind, bound, op = _CHECKS[key]
    if kind is float and isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    number = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if not number or value < bound or (op == ">" and value == bound):
        raise ConfigError(f"{path}: {key}={value!r} must be {'an integer' if kind is int else 'a number'} "
                          f"{op} {bound}")
    if key in ("eval_steps", "save_steps"):  # a number of steps, or (< 1) a share of all steps, as in the Trainer
        return int(value) if value >= 1 else float(value)
    return kind(value)


def _sort_keys(path, data: dict) -> tuple[dict, list[str], list[str]]:
    """(keys we act on, unused keys, refusal lines) -- see the module docstring."""
    ours, unused, refused = {}, [], []
    known = TRAIN_KEYS | PARALLEL_KEYS | set(EXTRA_PARALLEL)
    for key, value in data.items():
        key = str(key)
        if key in known:
            ours[key] = value
        elif is_logging(key):
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
        else:
            refused.append(f"unknown key {key!r} in {path}; {suggest(key, known)}")
    return ours, unused, refused


def _layout(path, d: dict, environ) -> tuple[ParallelismConfig, list[str]]:
    yaml_layout = {k: v for k, v in d.items() if k in PARALLEL_KEYS}
    if d.get("sequence_parallel_degree") not in (None, 1):  # Axolotl's older name of context_parallel_size
        yaml_layout.setdefault("context_parallel_size", d["sequence_parallel_degree"])
    settings, refused = map_fsdp(d.get("fsdp_version"), d.get("fsdp_config"))
    if settings.get("gradient_checkpointing"):
        d["gradient_checkpointing"] = True
    if settings.get("fsdp_offload_params"):
        yaml_layout.setdefault("fsdp_offload_params", True)
    sharded = d.get("fsdp") or d.get("fsdp_config") or d.get("fsdp_version")
    if sharded and "dp_shard_size" not in yaml_layout and not any(k.startswith("dp_") for k in yaml_layout):
        yaml_layout["dp_shard_size"] = -1  # Axolotl with FSDP on and no size: shard over the ranks left over
    # One precedence rule (nd_parallel/config): YAML overrides the PARALLELISM_CONFIG_* variables.
    layout = ParallelismConfig.merge(ParallelismConfig.env_overrides(environ), yaml_layout, source=str(path))
    if d.get("gradient_checkpointing") and layout.activation_checkpointing is None:
        layout = dataclasses.replace(layout, activation_checkpointing="full")
    return layout, [f"{k}: {why}" for k, why in refused]


def load_train_config(path: str | os.PathLike, environ=None) -> TrainConfig:
    """Parse and check a training YAML (no file of the model or data is opened yet)."""
    data = read_yaml_mapping(path)
    if data.get("auto_resume_from_checkpoints") is not None:  # Axolotl's switch for what "auto" does here
        if not isinstance(data["auto_resume_from_checkpoints"], bool):
            raise ConfigError(f"{path}: auto_resume_from_checkpoints={data['auto_resume_from_checkpoints']!r}; "
                              "use true or false")
        if data.pop("auto_resume_from_checkpoints") and data.get("resume_from_checkpoint") is None:
            data["resume_from_checkpoint"] = "auto"
    d, unused, refused = _sort_keys(path, data)
    refused += map_memory_keys(d) + value_refusals(d)
    if refused:
        raise ConfigError(f"{path}: {len(refused)} setting(s) cannot be used by nd-parallel train:\n  - "
                          + "\n  - ".join(refused))
    if "base_model" not in d:
        raise ConfigError(f"{path}: base_model is required: the local directory of a Hugging Face checkpoint "
                          "(config.json + *.safetensors), e.g. 'base_model: runs/tiny/model'")
    if d.get("layout", "auto") != "auto" or d.get("lr_scaling", "linear") not in ("linear", "sqrt"):
        raise ConfigError(f"{path}: layout={d.get('layout')!r} / lr_scaling={d.get('lr_scaling')!r}; "
                          "write 'layout: auto' (or leave it out) and 'lr_scaling: linear' or 'sqrt'")
    if d.get("layout") == "auto" and set(d) & (PARALLEL_KEYS - {"pp_backend", "cp_backend", "tp_plan", *RUN_OPTIONS}):
        raise ConfigError(f"{path}: layout: auto chooses the layout, but the file also sets "
                          f"{', '.join(sorted(set(d) & PARALLEL_KEYS))}; remove those keys or 'layout: auto'")
    for key in ("base_model", "output_dir", "lr_scheduler", "base_model_config", "tokenizer_config"):
        if key in d and d[key] is not None and not isinstance(d[key], str):
            raise ConfigError(f"{path}: {key}={d[key]!r} is a {type(d[key]).__name__}; write a string")
    for key in _BOOLS:
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise ConfigError(f"{path}: {key}={d[key]!r}; use true or false")
    layout, fsdp_refused = _layout(path, d, environ)
    if fsdp_refused:
        raise ConfigError(f"{path}: fsdp settings nd_parallel cannot honour:\n  - " + "\n  - ".join(fsdp_refused))
    train = {k: v for k, v in d.items() if k in _FIELDS and v is not None}
    specs = dataset_specs(path, d.get("datasets"), d.get("dataset_path"))
    for key in _CHECKS:
        if train.get(key) is not None:
            train[key] = _check_value(path, key, train[key])
    for key in ("base_model", "base_model_config", "tokenizer_config", "lora_model_dir", "output_dir",
                "dataset_prepared_path", "resume_from_checkpoint"):
        if isinstance(train.get(key), str) and not (key == "resume_from_checkpoint" and train[key] == "auto"):
            # relative paths start at the working directory, as in Axolotl
            train[key] = os.path.abspath(os.path.expanduser(train[key]))
    if "trainer_callbacks" in train:
        from .callbacks import callback_specs

        train["trainer_callbacks"] = callback_specs(path, train["trainer_callbacks"])
    return TrainConfig(**train, datasets=specs, parallel=layout, unused=sorted(set(unused)))
