"""Building a ParallelismConfig from a mapping, YAML, or the environment, and the one rule that orders them.

The one precedence rule: CLI flags > YAML > environment > defaults. A setting given at a higher level replaces the
same setting, under any of its names, from a lower one; `merge(env, yaml, cli)` applies it to mappings given lowest
first, and a setting no level gives keeps its default.

The PARALLELISM_CONFIG_* variables that `accelerate launch` sets are read here only (`env_overrides`, `from_env`).
The launcher's own variables (WORLD_SIZE, RANK, LOCAL_RANK, ...) are read at the launcher boundary, where a process
starts under its launcher (e.g. nd_parallel/accelerate/launcher_env.py, nd_parallel/cli/main.py), and
`ParallelismConfig.auto` reads WORLD_SIZE and LOCAL_WORLD_SIZE for its defaults.

The functions take the config class as `cls`, so that this module does not import parallelism.py, which calls them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import yaml

from .accelerate_api import check_cp_comm_strategy
from .checks import ConfigError, ConfigTypeError, _kind, _suggest
from .layout import SIZE_FIELDS

AXOLOTL_ALIASES = {"tensor_parallel_size": "tp_size", "context_parallel_size": "cp_size",
                   "pipeline_parallel_size": "pp_size", "torch_compile": "compile",
                   "torch_compile_backend": "compile_backend"}
_ENV_PREFIX = "PARALLELISM_CONFIG_"
_ENV_INTS = {name.upper(): name for name in (*SIZE_FIELDS, "ep_size", "pp_microbatches", "pp_virtual_stages")}
_ENV_STRINGS = {"PP_SCHEDULE": "pp_schedule", "PP_BACKEND": "pp_backend"}
_ENV_SPECIAL = ("CP_BACKEND", "PP_BALANCE", "CP_LOAD_BALANCE", "SP_SIZE", "SP_BACKEND", "CP_COMM_STRATEGY")
# Set by accelerate only with sp_size > 1, which SP_SIZE already refuses.
_ENV_IGNORED = ("SP_SEQ_LENGTH", "SP_SEQ_LENGTH_IS_VARIABLE", "SP_ATTN_IMPLEMENTATION")
_ENV_KNOWN = (*_ENV_INTS, *_ENV_STRINGS, *_ENV_SPECIAL, *_ENV_IGNORED)

_ConfigT = TypeVar("_ConfigT")


def parallel_keys(cls: type) -> frozenset[str]:
    """Every key `from_dict(cls, ...)` accepts: the field names of `cls` plus Axolotl's aliases."""
    return frozenset({f.name for f in dataclasses.fields(cls)} | set(AXOLOTL_ALIASES))


def from_dict(cls: type[_ConfigT], d: Mapping[str, Any], *, source: str = "config") -> _ConfigT:
    """Build from a mapping of field names or Axolotl's aliases (see PARALLEL_KEYS).

    A size given as None (YAML `null`) means "not set": 1, except dp_shard_size, which becomes
    -1 because Axolotl reads an unset dp_shard_size as "all ranks left over".
    """
    kwargs = _canonical(cls, d, source)
    for name in SIZE_FIELDS:
        if name in kwargs and kwargs[name] is None:
            kwargs[name] = -1 if name == "dp_shard_size" else 1
    try:
        with _explicit_only():  # the levels are the caller's: the constructor must not add the environment
            return cls(**kwargs)
    except ConfigError as err:
        raise type(err)(f"in {source}: {err}") from None


def merge(cls: type[_ConfigT], *layers: Mapping[str, Any], source: str = "merged config") -> _ConfigT:
    """Build from mappings given lowest precedence first, e.g. merge(env, yaml, cli); a later
    key replaces the same setting, under any alias. Pass only the settings the user gave."""
    merged: dict[str, Any] = {}
    for i, layer in enumerate(layers):
        merged.update(_canonical(cls, layer, f"{source} (layer {i})"))
    return from_dict(cls, merged, source=source)


def from_yaml(cls: type[_ConfigT], path_or_text: str | os.PathLike, *, source: str | None = None) -> _ConfigT:
    """Build from a YAML file path, or from YAML text; plain values only (yaml.safe_load)."""
    text, source = _read_yaml_source(path_or_text, source)
    data = safe_load_yaml(text, source)
    if data is None:  # an empty file: every setting keeps its default
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigTypeError(f"top level of {source} is {_kind(data)}, expected a mapping "
                              "of keys such as tp_size: 2")
    return from_dict(cls, data, source=source)


def from_env(cls: type[_ConfigT], environ: Mapping[str, str] | None = None) -> _ConfigT:
    """Build from PARALLELISM_CONFIG_* (default os.environ); unset ones keep their defaults."""
    return from_dict(cls, env_overrides(environ), source="PARALLELISM_CONFIG_* variables")


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the PARALLELISM_CONFIG_* variables give, as a dict (e.g. for `merge`).

    Empty variables count as unset. accelerate always sets CP_BACKEND to "torch" (its only choice), so
    that value is ignored; "ring" / "ulysses" are used when CP_SIZE > 1. Pick the torch backend with
    ParallelismConfig(cp_backend="torch") or cp_backend in the YAML. accelerate's SP_BACKEND and CP_COMM_STRATEGY pass
    at the values its launcher writes by default and are refused otherwise (accelerate_api.check_cp_comm_strategy).
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
    # CP_COMM_STRATEGY and SP_BACKEND are written by accelerate's launcher with its defaults, which say nothing;
    # another value is a setting we do not have.
    check_cp_comm_strategy(raw.get("CP_COMM_STRATEGY"), f"{_ENV_PREFIX}CP_COMM_STRATEGY")
    if raw.get("SP_BACKEND", "deepspeed") != "deepspeed":
        raise ConfigError(f"{_ENV_PREFIX}SP_BACKEND={raw['SP_BACKEND']!r} is not one of accelerate's values "
                          "('deepspeed'); remove parallelism_config_sp_backend (sequence parallelism is cp here)")
    # accelerate's launcher can only write CP_BACKEND=torch, and always does: it says nothing about the
    # user's choice, so it keeps our default (ring, which runs everywhere). A hand-set ring / ulysses counts.
    if "CP_BACKEND" in raw and raw["CP_BACKEND"] != "torch" and out.get("cp_size", 1) > 1:
        out["cp_backend"] = raw["CP_BACKEND"]
    if "PP_BALANCE" in raw:
        out["pp_balance"] = _env_balance(raw["PP_BALANCE"])
    if "CP_LOAD_BALANCE" in raw:
        out["cp_load_balance"] = _env_bool("CP_LOAD_BALANCE", raw["CP_LOAD_BALANCE"])
    return out


def _canonical(cls: type, d: Any, source: str) -> dict[str, Any]:
    """Field-named copy of a mapping: aliases resolved, unknown keys and conflicts refused."""
    if not isinstance(d, Mapping):
        raise ConfigTypeError(
            f"{source} must be a mapping of keys such as tp_size: 2, got {_kind(d)}")
    keys = parallel_keys(cls)
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in d.items():
        if key not in keys:
            raise ConfigError(f"unknown key {key!r} in {source}; "
                              + _suggest(key, sorted(keys), noun="keys"))
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


def yaml_number(value):
    """``value`` as a float where it is a string that reads as one, else as given: PyYAML reads a number written
    without a dot (1e-4) as a string, and Axolotl's schema takes it as the number."""
    if not isinstance(value, str):
        return value
    try:
        return float(value)
    except ValueError:
        return value


def safe_load_yaml(text: str, source: str) -> Any:
    """yaml.safe_load of ``text``; a syntax error or a tag raises ConfigError naming ``source``, line and column."""
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


# ---------------------------------------------------------------- the constructor, as Accelerate's

_FILL_FROM_ENV = contextvars.ContextVar("nd_parallel_fill_from_env", default=True)


@contextlib.contextmanager
def _explicit_only():
    token = _FILL_FROM_ENV.set(False)
    try:
        yield
    finally:
        _FILL_FROM_ENV.reset(token)


def reads_env_for_unset(cls: type[_ConfigT]) -> type[_ConfigT]:
    """Make ``cls(**given)`` read PARALLELISM_CONFIG_* for every setting not given, as Accelerate's
    ``ParallelismConfig()`` does (``accelerate launch --config_file`` passes the layout that way, and scripts such as
    Accelerate's ``nd_parallel_trainer.py`` build ``ParallelismConfig()`` to read it): keyword arguments >
    environment > defaults. The readers above (from_dict, merge, from_yaml, from_env) state their levels themselves
    and do not add it; ``dataclasses.replace`` passes every field, so it never does either."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **given: Any) -> None:
        if _FILL_FROM_ENV.get() and any(f.init and f.name not in given for f in dataclasses.fields(cls)):
            env = env_overrides()
            given = {**{k: v for k, v in env.items() if k not in given}, **given}
        with _explicit_only():  # a subclass's __init__ calling this one reads the environment once
            init(self, **given)

    cls.__init__ = __init__
    return cls
