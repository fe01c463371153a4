"""The degrees and options of an N-D parallel layout, validated before any process group exists.

`ParallelismConfig` holds one size per parallel dimension (pp, dp_replicate, dp_shard, cp, tp) and
the options of the pipeline and context-parallel backends. Build it from keyword arguments, a dict
(`from_dict`, which also takes Axolotl's key names), YAML (`from_yaml`), or the
`PARALLELISM_CONFIG_*` variables that `accelerate launch` sets (`from_env`).

The one precedence rule: CLI flags > YAML > environment > defaults. A setting given at a higher
level replaces the same setting from a lower one; `ParallelismConfig.merge(env, yaml, cli)` applies
it to mappings given lowest first. Environment variables are read here only (`from_env`,
`env_overrides`), never deeper in the library.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

# Mesh order, outermost first; error messages print the equation in this order too.
SIZE_FIELDS = ("pp_size", "dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
PP_BACKENDS = ("torch", "deepspeed")
PP_BALANCE_NAMES = ("uniform", "profile")
CP_BACKENDS = ("ring", "ulysses", "torch")
AC_MODES = (None, "full", "selective")
# How a run reacts to faults, not part of the layout: `layout: auto` keeps them from the YAML.
RUN_OPTIONS = ("hang_timeout", "save_on_signal", "skip_nonfinite_steps", "async_save")
AXOLOTL_ALIASES = {"tensor_parallel_size": "tp_size", "context_parallel_size": "cp_size",
                   "pipeline_parallel_size": "pp_size"}
# What the neutral value of each counted field means; quoted as the fix in error messages.
_NEUTRAL = {
    "pp_size": "pp_size=1 to disable pipeline parallelism",
    "dp_replicate_size": "dp_replicate_size=1 to disable replicated data parallelism",
    "dp_shard_size": "dp_shard_size=1 to disable sharding, or -1 to shard over the ranks left over",
    "cp_size": "cp_size=1 to disable context parallelism",
    "tp_size": "tp_size=1 to disable tensor parallelism",
    "pp_virtual_stages": "pp_virtual_stages=1 for one pipeline stage per rank",
    "pp_microbatches": "pp_microbatches=None for one micro-batch per pipeline stage",
    "pp_timeline_step": "pp_timeline_step=3 (the third step)",
    "activation_checkpointing_every": "activation_checkpointing_every=1 to checkpoint every layer",
}
_ENV_PREFIX = "PARALLELISM_CONFIG_"
_ENV_INTS = {name.upper(): name for name in (*SIZE_FIELDS, "pp_microbatches", "pp_virtual_stages")}
_ENV_STRINGS = {"PP_SCHEDULE": "pp_schedule", "PP_BACKEND": "pp_backend"}
_ENV_SPECIAL = ("CP_BACKEND", "PP_BALANCE", "CP_LOAD_BALANCE", "SP_SIZE")
# Set by accelerate for its DeepSpeed sequence parallelism and its own CP; they do not apply here.
_ENV_IGNORED = ("SP_BACKEND", "CP_COMM_STRATEGY", "SP_SEQ_LENGTH", "SP_SEQ_LENGTH_IS_VARIABLE",
                "SP_ATTN_IMPLEMENTATION")
_ENV_KNOWN = (*_ENV_INTS, *_ENV_STRINGS, *_ENV_SPECIAL, *_ENV_IGNORED)


class ConfigError(ValueError):
    """An invalid parallelism setting; the message names the value and the fix."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type (catchable as ValueError or as TypeError)."""


@dataclass(kw_only=True)
class ParallelismConfig:
    """Sizes of the five parallel dimensions and the options of their backends."""

    dp_replicate_size: int = 1
    """Data-parallel replicas, each with a full copy of the weights (HSDP). Default 1; >= 1."""
    dp_shard_size: int = 1
    """Ranks sharding weights, grads, optimizer state. Default 1; >= 1, or -1 = the ranks left."""
    tp_size: int = 1
    """Tensor-parallel ranks splitting each Linear of a layer. Default 1; >= 1."""
    cp_size: int = 1
    """Context-parallel ranks splitting the sequence. Default 1; >= 1."""
    pp_size: int = 1
    """Pipeline-parallel ranks, each holding a slice of the layer stack. Default 1; >= 1."""
    tp_plan: dict[str, str | None] | None = None
    """Overrides of the model's TP plan: pattern -> style, or None to drop. Default None = as is."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: "1f1b" (default), "gpipe", "interleaved-1f1b", "interleaved-zb", "zbv"."""
    pp_microbatches: int | None = None
    """Micro-batches per step under PP. Default None (= pp_size); otherwise >= 1."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank. Default 1; >= 2 for interleaved schedules, exactly 2 for "zbv"."""
    pp_backend: str = "torch"
    """Pipeline engine. Default "torch" (torch.distributed.pipelining); or "deepspeed"."""
    pp_balance: str | list[int] = "uniform"
    """Layers per stage: "uniform" (default), "profile", or a list of pp_size*pp_virtual_stages."""
    pp_profile_shape: tuple[int, int] | None = None
    """(micro-batch size, sequence length) pp_balance="profile" measures. Default None = (1, min(max positions, 512))."""
    pp_timeline: str | None = None
    """Directory for one step's pipeline timeline (timeline.json for Perfetto, timeline.png). Default None = off."""
    pp_timeline_step: int = 3
    """The step (1-based) that pp_timeline records; the first ones pay for start-up. Default 3; >= 1."""
    cp_backend: str = "ring"
    """Context-parallel attention: "ring" (default), "ulysses" (all-to-all), "torch" (CUDA only)."""
    cp_load_balance: bool = True
    """Reorder sequence chunks so causal attention costs the same on every CP rank. Default True."""
    activation_checkpointing: str | None = None
    """Recompute activations in backward: None (default, off), "full" (each decoder layer keeps only its input)
    or "selective" (keep matmul/attention outputs, recompute norms, activations, elementwise ops)."""
    activation_checkpointing_every: int = 1
    """Checkpoint every k-th decoder layer of each model part. Default 1 (all); >= 1."""
    hang_timeout: float | None = None
    """Seconds a rank may wait in one collective before the run is declared hung: every rank then prints which ranks
    are missing and where it stands, and exits non-zero (nd_parallel/fault/watchdog.py). Default None = the backend's
    own timeout (600 on CUDA, 1800 on CPU); 0 = off; otherwise >= 5. Set it above the longest legitimate wait."""
    save_on_signal: bool = False
    """Catch SIGTERM/SIGINT so the loop can write a preemption checkpoint after the current optimizer step
    (``plugin.preemption_requested()``). Default False (the signals end the process at once)."""
    skip_nonfinite_steps: int = 0
    """Optimizer steps with a NaN/Inf loss or gradient norm that are skipped (not applied) before the run stops.
    Default 0 = stop at the first, naming the step, rank and parameter; >= 0."""
    async_save: bool = False
    """save_state returns once the state is copied; torch.distributed.checkpoint writes it in the background and
    the checkpoint is published when every rank's files are written. Default False."""

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            setattr(self, name, _check_count(name, getattr(self, name)))
        if self.pp_microbatches is not None:
            self.pp_microbatches = _check_count("pp_microbatches", self.pp_microbatches)
        self.pp_virtual_stages = _check_count("pp_virtual_stages", self.pp_virtual_stages)
        self.pp_timeline_step = _check_count("pp_timeline_step", self.pp_timeline_step)
        self.pp_profile_shape = _check_shape(self.pp_profile_shape)
        if self.pp_timeline is not None and not isinstance(self.pp_timeline, str):
            raise ConfigTypeError(f"pp_timeline={self.pp_timeline!r} is {_kind(self.pp_timeline)}; give a directory "
                                  "path such as pp_timeline='runs/timeline', or None")
        self.tp_plan = _check_tp_plan(self.tp_plan)
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _check_choice("pp_backend", self.pp_backend, PP_BACKENDS)
        _check_choice("cp_backend", self.cp_backend, CP_BACKENDS)
        if not isinstance(self.cp_load_balance, bool):
            raise ConfigTypeError(f"cp_load_balance={self.cp_load_balance!r} is "
                                  f"{_kind(self.cp_load_balance)}; write True or False")
        check_activation_checkpointing(self.activation_checkpointing)
        self.activation_checkpointing_every = _check_count("activation_checkpointing_every",
                                                           self.activation_checkpointing_every)
        self._check_fault_options()
        self._check_pipeline()
        self._check_deepspeed()
        self.pp_balance = _check_balance(self.pp_balance, self.pp_size, self.pp_virtual_stages)

    def _check_fault_options(self) -> None:
        timeout = self.hang_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
            raise ConfigTypeError(f"hang_timeout={timeout!r} is {_kind(timeout)}; give seconds such as "
                                  "hang_timeout=600, 0 to turn hang detection off, or None for the backend default")
        if timeout is not None and not (timeout == 0 or 5 <= timeout < math.inf):
            raise ConfigError(f"hang_timeout={timeout} must be 0 (off) or at least 5 seconds (the heartbeat needs a "
                              "few beats to tell a stopped rank from a slow one); for example hang_timeout=600")
        for name in ("save_on_signal", "async_save"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(f"{name}={getattr(self, name)!r} is {_kind(getattr(self, name))}; write True "
                                      "or False")
        skip = self.skip_nonfinite_steps
        if not _is_int(skip) or skip < 0:
            raise ConfigError(f"skip_nonfinite_steps={skip!r} must be a whole number >= 0: 0 stops at the first "
                              "non-finite loss or gradient norm, N skips up to N such steps")

    def _check_pipeline(self) -> None:
        schedule, stages = self.pp_schedule, self.pp_virtual_stages
        if schedule == "zbv" and stages != 2:
            raise ConfigError(f"pp_schedule='zbv' places exactly 2 stages per rank, but pp_virtual_"
                              f"stages={stages}; set pp_virtual_stages=2, or use 'interleaved-zb'")
        if schedule.startswith("interleaved") and stages < 2:
            raise ConfigError(f"pp_schedule={schedule!r} needs pp_virtual_stages >= 2 (several "
                              f"stages per rank), got pp_virtual_stages={stages}; set "
                              "pp_virtual_stages=2, or use pp_schedule='1f1b'")
        if schedule in ("gpipe", "1f1b") and stages > 1:
            raise ConfigError(f"pp_schedule={schedule!r} runs one stage per rank, but pp_virtual_"
                              f"stages={stages}; use pp_schedule='interleaved-1f1b' for {stages} "
                              "stages per rank, or pp_virtual_stages=1")

    def _check_deepspeed(self) -> None:
        if self.pp_backend != "deepspeed":
            return
        clashes = [f"{n}={getattr(self, n)}" for n in ("dp_shard_size", "tp_size", "cp_size")
                   if getattr(self, n) > 1]  # dp_shard_size=-1 is checked again after resolve()
        if clashes:
            raise ConfigError(
                f"pp_backend='deepspeed' cannot be combined with {', '.join(clashes)}: DeepSpeed's "
                "pipeline engine supports data parallelism with ZeRO stage <= 1 only; use "
                "dp_replicate_size for data parallelism, or pp_backend='torch' to combine the "
                "pipeline with sharding, tensor or context parallelism")
        if self.pp_schedule != "1f1b":
            raise ConfigError(f"pp_backend='deepspeed' runs its own 1F1B-style schedule, so "
                              f"pp_schedule={self.pp_schedule!r} cannot apply; use "
                              "pp_schedule='1f1b', or pp_backend='torch' for other schedules")

    @property
    def sizes(self) -> dict[str, int]:
        """Size per mesh dimension, outermost first: pp, dp_replicate, dp_shard, cp, tp."""
        return {name.removesuffix("_size"): getattr(self, name) for name in SIZE_FIELDS}

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: dp_replicate_size * dp_shard_size."""
        self._require_resolved("dp_size")
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def world_size(self) -> int:
        """Number of ranks the layout needs: the product of the five sizes."""
        self._require_resolved("world_size")
        return math.prod(self.sizes.values())

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: pp_microbatches, or pp_size when that is None."""
        return self.pp_microbatches if self.pp_microbatches is not None else self.pp_size

    def _require_resolved(self, what: str) -> None:
        if self.dp_shard_size == -1:
            raise ConfigError(f"{what} is unknown while dp_shard_size=-1 (the ranks left over); "
                              "call config = config.resolve(world_size) first")

    def _equation(self, skip: str = "") -> str:
        return " * ".join(f"{n}({getattr(self, n)})" for n in SIZE_FIELDS if n != skip)

    def resolve(self, world_size: int) -> ParallelismConfig:
        """A copy with dp_shard_size=-1 filled in, checked against `world_size` ranks."""
        if _is_int(world_size) and world_size >= 1:
            world_size = int(world_size)
        else:
            raise ConfigError(f"world_size={world_size!r} must be a positive integer")
        others = math.prod(getattr(self, n) for n in SIZE_FIELDS if n != "dp_shard_size")
        if self.dp_shard_size == -1:
            if world_size % others:
                raise ConfigError(
                    f"dp_shard_size=-1 takes the ranks left over, but the world size {world_size} "
                    f"is not divisible by {self._equation(skip='dp_shard_size')} = {others}; "
                    f"change those sizes so their product divides {world_size}")
            resolved = dataclasses.replace(self, dp_shard_size=world_size // others)
        else:
            resolved = dataclasses.replace(self)
        if resolved.world_size != world_size:
            fix = (f"for example dp_shard_size={world_size // others}" if world_size % others == 0
                   else "dp_shard_size=-1 takes the ranks left over")
            raise ConfigError(
                f"{resolved._equation()} = {resolved.world_size}, but the world size is "
                f"{world_size}; change the sizes so their product is {world_size} ({fix})")
        return resolved

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (copies; safe to modify)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line: the sizes, the world size, and any option that differs from its default."""
        parts = [f"{dim}={size}" for dim, size in self.sizes.items()]
        parts.append("(world unresolved)" if self.dp_shard_size == -1
                     else f"(world {self.world_size})")
        parts += [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if f.name not in SIZE_FIELDS and getattr(self, f.name) != f.default]
        return " ".join(parts)

    def __str__(self) -> str:
        return self.describe()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "config") -> ParallelismConfig:
        """Build from a mapping of field names or Axolotl's aliases (see PARALLEL_KEYS).

        A size given as None (YAML `null`) means "not set": 1, except dp_shard_size, which becomes
        -1 because Axolotl reads an unset dp_shard_size as "all ranks left over".
        """
        kwargs = _canonical(d, source)
        for name in SIZE_FIELDS:
            if name in kwargs and kwargs[name] is None:
                kwargs[name] = -1 if name == "dp_shard_size" else 1
        try:
            return cls(**kwargs)
        except ConfigError as err:
            raise type(err)(f"in {source}: {err}") from None

    @classmethod
    def merge(cls, *layers: Mapping[str, Any], source: str = "merged config") -> ParallelismConfig:
        """Build from mappings given lowest precedence first, e.g. merge(env, yaml, cli); a later
        key replaces the same setting, under any alias. Pass only the settings the user gave."""
        merged: dict[str, Any] = {}
        for i, layer in enumerate(layers):
            merged.update(_canonical(layer, f"{source} (layer {i})"))
        return cls.from_dict(merged, source=source)

    @classmethod
    def from_yaml(cls, path_or_text: str | os.PathLike, *, source: str | None = None,
                  ) -> ParallelismConfig:
        """Build from a YAML file path, or from YAML text; plain values only (yaml.safe_load)."""
        text, source = _read_yaml_source(path_or_text, source)
        data = _safe_load(text, source)
        if data is None:  # an empty file: every setting keeps its default
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigTypeError(f"top level of {source} is {_kind(data)}, expected a mapping "
                                  "of keys such as tp_size: 2")
        return cls.from_dict(data, source=source)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ParallelismConfig:
        """Build from PARALLELISM_CONFIG_* (default os.environ); unset ones keep their defaults."""
        return cls.from_dict(cls.env_overrides(environ), source="PARALLELISM_CONFIG_* variables")

    @classmethod
    def auto(cls, model: Any, *, seq_len: int, global_batch: int, world_size: int | None = None,
             gpus_per_node: int | None = None, gpu_memory: int | str | None = None, dtype: str = "bf16",
             lora_rank: int | None = None, **cluster: Any) -> ParallelismConfig:
        """The layout planner's top plan (nd_parallel.planner) for the ranks actually launched.

        `model`: a checkpoint directory, a config.json, a model (meta or real) or a planner ModelSpec.
        `world_size` defaults to WORLD_SIZE and `gpus_per_node` to LOCAL_WORLD_SIZE (both set by the launcher),
        `gpu_memory` to the device's memory ("80GiB" or bytes); `cluster` passes the planner's Cluster fields
        (intra_bw, inter_bw, flops, ...). The chosen plan (micro-batch, accumulation, predicted peak memory and
        step time) is kept as `config.plan`. A request nothing fits raises ConfigError with the planner's hint.
        """
        from nd_parallel.planner import PlannerError
        from nd_parallel.planner.auto import config_kwargs, fields_of, top_plan

        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        try:
            plan = top_plan(model, world_size=world, seq_len=seq_len, global_batch=global_batch,
                            gpus_per_node=per_node, gpu_memory=gpu_memory, dtype=dtype, lora_rank=lora_rank, **cluster)
            config = cls(**config_kwargs(plan, fields_of(cls)))
        except PlannerError as err:
            raise ConfigError(f"ParallelismConfig.auto: {err}") from None
        config.plan = plan
        return config

    @staticmethod
    def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The settings the PARALLELISM_CONFIG_* variables give, as a dict (e.g. for `merge`).

        Empty variables count as unset. accelerate always sets CP_BACKEND to "torch" (its only choice), so
        that value is ignored; "ring" / "ulysses" are used when CP_SIZE > 1. Pick the torch backend with
        ParallelismConfig(cp_backend="torch") or cp_backend in the YAML. accelerate's SP_* and CP_COMM_STRATEGY are ignored.
        """
        env = os.environ if environ is None else environ
        raw = {k[len(_ENV_PREFIX):]: v.strip() for k, v in env.items()
               if k.startswith(_ENV_PREFIX) and v.strip()}
        unknown = [_ENV_PREFIX + suffix for suffix in raw if suffix not in _ENV_KNOWN]
        if unknown:
            raise ConfigError(f"unknown environment variable {unknown[0]}; "
                              + _suggest(unknown[0], [_ENV_PREFIX + k for k in _ENV_KNOWN]))
        out: dict[str, Any] = {n: _env_int(s, raw[s]) for s, n in _ENV_INTS.items() if s in raw}
        out.update({name: raw[s] for s, name in _ENV_STRINGS.items() if s in raw})
        if "SP_SIZE" in raw and _env_int("SP_SIZE", raw["SP_SIZE"]) > 1:
            raise ConfigError(
                f"{_ENV_PREFIX}SP_SIZE={raw['SP_SIZE']}: accelerate's sp_size (DeepSpeed Ulysses) "
                "is not supported; use cp_size with cp_backend='ulysses' instead")
        # accelerate's launcher can only write CP_BACKEND=torch, and always does: it says nothing about the
        # user's choice, so it keeps our default (ring, which runs everywhere). A hand-set ring / ulysses counts.
        if "CP_BACKEND" in raw and raw["CP_BACKEND"] != "torch" and out.get("cp_size", 1) > 1:
            out["cp_backend"] = raw["CP_BACKEND"]
        if "PP_BALANCE" in raw:
            out["pp_balance"] = _env_balance(raw["PP_BALANCE"])
        if "CP_LOAD_BALANCE" in raw:
            out["cp_load_balance"] = _env_bool("CP_LOAD_BALANCE", raw["CP_LOAD_BALANCE"])
        return out


PARALLEL_KEYS: frozenset[str] = frozenset(
    {f.name for f in dataclasses.fields(ParallelismConfig)} | set(AXOLOTL_ALIASES))
"""Every key from_dict accepts: the field names plus Axolotl's aliases."""


def check_activation_checkpointing(mode: Any) -> None:
    """One of AC_MODES, or a ConfigError naming the value and the modes."""
    if mode not in AC_MODES:
        raise ConfigError(f"activation_checkpointing={mode!r} is not a mode; use None (off), 'full' (recompute "
                          "each decoder layer) or 'selective' (keep matmul and attention outputs, recompute the rest)")


def _kind(value: Any) -> str:
    """'an int', 'a str': the type of a bad value, for messages."""
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _suggest(value: Any, choices: list[str] | tuple[str, ...], noun: str = "values") -> str:
    """'did you mean ...?' when a choice is close, else the list of valid choices."""
    value = str(value)
    # Retry lower-cased so that "Interleaved1F1B" still finds "interleaved-1f1b".
    close = (difflib.get_close_matches(value, choices, n=1)
             or difflib.get_close_matches(value.lower(), choices, n=1))
    if close:
        return f"did you mean {close[0]!r}?"
    return f"valid {noun} are: " + ", ".join(repr(c) for c in sorted(choices))


def _int_guess(value: Any) -> int | None:
    """The integer a mistyped count most likely meant, if there is one."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def _check_count(name: str, value: Any) -> int:
    """A positive integer (dp_shard_size may also be -1), returned as a plain int."""
    if not _is_int(value):
        what = "sizes must be integers" if name in SIZE_FIELDS else f"{name} must be an integer"
        guess = _int_guess(value)
        fix = f"write {name}={guess}" if guess is not None else f"for example use {_NEUTRAL[name]}"
        raise ConfigTypeError(f"{name}={value!r} is {_kind(value)}; {what}, {fix}")
    value = int(value)
    if value == -1 and name == "dp_shard_size":
        return value
    if value == -1:
        raise ConfigError(
            f"{name}=-1 is not allowed: only dp_shard_size may be -1 (the ranks left over); "
            f"give {name} a positive value, for example {_NEUTRAL[name]}")
    if value < 1:
        also = " or -1" if name == "dp_shard_size" else ""
        raise ConfigError(f"{name}={value} must be a positive integer{also}; use {_NEUTRAL[name]}")
    return value


def _check_shape(shape: Any) -> tuple[int, int] | None:
    """None, or (micro-batch size, sequence length) as two positive integers."""
    if shape is None:
        return None
    if not isinstance(shape, (list, tuple)) or len(shape) != 2 or not all(_is_int(v) and v >= 1 for v in shape):
        raise ConfigError(f"pp_profile_shape={shape!r} must be two positive integers (micro-batch size, sequence "
                          "length), for example pp_profile_shape=(1, 512)")
    return (int(shape[0]), int(shape[1]))


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    valid = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise ConfigTypeError(f"{name}={value!r} is {_kind(value)}; expected one of {valid}")
    if value not in choices:
        raise ConfigError(f"unknown {name}={value!r}; {_suggest(value, choices)} (valid: {valid})")


def _check_tp_plan(plan: Any) -> dict[str, str | None] | None:
    example = "{'layers.*.mlp.down_proj': 'rowwise'}"
    if plan is not None and not isinstance(plan, Mapping):
        raise ConfigTypeError(f"tp_plan={plan!r} is {_kind(plan)}; expected a dict of module "
                              f"pattern -> style such as {example}, or None for the model's plan")
    for key, style in (plan or {}).items():
        if not isinstance(key, str):
            raise ConfigTypeError(f"tp_plan key {key!r} is {_kind(key)}; keys are module name "
                                  f"patterns (str) such as {example}")
        if style is not None and not isinstance(style, str):
            raise ConfigTypeError(f"tp_plan[{key!r}]={style!r} is {_kind(style)}; values are style "
                                  "names such as 'colwise' or 'rowwise', or None to drop the entry")
    return None if plan is None else dict(plan)


def _check_balance(balance: Any, pp_size: int, virtual: int) -> str | list[int]:
    if isinstance(balance, str):
        _check_choice("pp_balance", balance, PP_BALANCE_NAMES)
        return balance
    if not isinstance(balance, (list, tuple)):
        raise ConfigTypeError(f"pp_balance={balance!r} is {_kind(balance)}; use 'uniform', "
                              "'profile', or a list of layers per stage such as [4, 4]")
    for i, layers in enumerate(balance):
        if not _is_int(layers):
            raise ConfigTypeError(f"pp_balance[{i}]={layers!r} is {_kind(layers)}; entries are "
                                  "layer counts (integers), e.g. pp_balance=[4, 4]")
        if layers < 1:
            raise ConfigError(f"pp_balance[{i}]={layers} must be a positive number of layers; "
                              "every stage needs at least one layer")
    if len(balance) != pp_size * virtual:
        raise ConfigError(
            f"pp_balance={list(balance)} has {len(balance)} entries, but pp_size({pp_size}) * "
            f"pp_virtual_stages({virtual}) = {pp_size * virtual} stages; give one layer count "
            "per stage, or use pp_balance='uniform'")
    return [int(x) for x in balance]


def _canonical(d: Any, source: str) -> dict[str, Any]:
    """Field-named copy of a mapping: aliases resolved, unknown keys and conflicts refused."""
    if not isinstance(d, Mapping):
        raise ConfigTypeError(
            f"{source} must be a mapping of keys such as tp_size: 2, got {_kind(d)}")
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in d.items():
        if key not in PARALLEL_KEYS:
            raise ConfigError(f"unknown key {key!r} in {source}; "
                              + _suggest(key, sorted(PARALLEL_KEYS), noun="keys"))
        name = AXOLOTL_ALIASES.get(key, key)
        if name in out and out[name] != value:
            raise ConfigError(
                f"{source} sets both {given_as[name]}={out[name]!r} and {key}={value!r}, which "
                "name the same setting; keep only one of them")
        out[name], given_as[name] = value, key
    return out


def _read_yaml_source(arg: Any, source: str | None) -> tuple[str, str]:
    """(text, name for messages); a str is a path if such a file exists or it looks like one."""
    if not isinstance(arg, (str, os.PathLike)):
        raise ConfigTypeError(f"from_yaml expects a file path or YAML text, got {_kind(arg)}")
    if isinstance(arg, str) and not os.path.isfile(arg) and (
            "\n" in arg or ": " in arg or not arg.strip().endswith((".yaml", ".yml"))):
        return arg, source or "YAML text"
    path = os.fspath(arg)
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(), source or path
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist; pass an existing YAML file "
                          "or YAML text") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path!r}: {err}") from err


def _safe_load(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)  # safe_load only: reading a config must never run code
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        tag = re.search(r"constructor for the tag '([^']+)'", problem)
        if isinstance(err, yaml.constructor.ConstructorError) and tag:
            name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
            raise ConfigError(f"{source}{where}: refusing the tag {name}: only plain YAML values "
                              "are allowed (numbers, strings, booleans, lists, mappings); remove "
                              "the tag") from err
        raise ConfigError(f"{source}{where}: malformed YAML: {problem}; fix the syntax there "
                          "(settings look like 'tp_size: 2')") from err


def _env_int(suffix: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{_ENV_PREFIX}{suffix}={text!r} is not an integer; set a whole number "
                          f"such as {_ENV_PREFIX}{suffix}=2") from None


def _env_bool(suffix: str, text: str) -> bool:
    if text.lower() not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        raise ConfigError(f"{_ENV_PREFIX}{suffix}={text!r} is not a boolean; use true/false or 1/0")
    return text.lower() in ("true", "1", "yes", "on")


def _env_balance(text: str) -> str | list[int]:
    """'uniform'/'profile' stay names (validated later); anything with digits is a list."""
    if not re.search(r"\d", text):
        return text
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"{_ENV_PREFIX}PP_BALANCE={text!r} is neither a balance name ('uniform', 'profile') "
            "nor comma-separated layer counts such as '4,4'") from None
