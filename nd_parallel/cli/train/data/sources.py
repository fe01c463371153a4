"""Axolotl's `datasets:` entries: parsed and checked (`DatasetSpec`), then read from local files with `datasets`.

Only local data is read (files, directories of files, or a `save_to_disk` directory): nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nd_parallel.config import ConfigError

from . import instructions
from .dpo_types import TYPES as DPO_TYPES
from .kto import TYPES as KTO_TYPES
from .orpo import TYPES as ORPO_TYPES

TYPES = ("completion", "alpaca", "chat_template", "pretraining", "tokenized")
# reward_model / process_reward_model's formats (reward.py; cli/train/reward.py pairs them with those keys)
REWARD_TYPES = ("bradley_terry.chat_template", "stepwise_supervised")
# Axolotl's instruction types besides alpaca (instructions.py): alpaca:<style>, alpaca_chat, jeopardy[:<style>].
INSTRUCTION_TYPES = ("alpaca:chat", "alpaca:chatml", "alpaca:phi", "alpaca_chat", "jeopardy")
# Axolotl's names for the same formats.
TYPE_ALIASES = {"pretrain": "pretraining", "sharegpt": None, "chat_template.default": "chat_template"}
DS_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow",
            ".txt": "text"}
# Axolotl's default role names (chat_template strategy): dataset role -> template role.
DEFAULT_ROLES = {"user": ["user", "human"], "assistant": ["assistant", "gpt", "model"], "system": ["system"],
                 "tool": ["tool"]}


def suggest(key: str, choices) -> str:
    """'did you mean ...?' for a mistyped key, else the valid keys."""
    close = difflib.get_close_matches(key, sorted(choices), n=1)
    return f"did you mean {close[0]!r}?" if close else "valid keys are: " + ", ".join(sorted(choices))


@dataclass
class DatasetSpec:
    """One `datasets:` entry, with Axolotl's key names and defaults."""

    path: str
    """Local file or directory (json/jsonl/parquet/csv/arrow/txt files, or a `save_to_disk` directory)."""
    type: str = "completion"
    """completion | alpaca (alpaca:<style>, alpaca_chat, jeopardy[:<style>]) | chat_template | pretraining
    (Axolotl's meanings) | tokenized (Axolotl's `type:` left empty: records with input_ids and labels)."""
    ds_type: str | None = None
    """json | parquet | csv | arrow | text; default: from the file extension."""
    split: str = "train"
    """Split to read (Axolotl's default "train"), with an optional slice as `datasets` writes it: train[:20%],
    train[10:100], train[-50:] (applied to the local rows; a bound past the rows is refused)."""
    data_files: str | list[str] | None = None
    """Files inside `path` (or absolute) to read instead of everything in it."""
    field: str | None = None
    """completion/pretraining: the text column (default "text")."""
    field_messages: str = "messages"
    """chat_template: the column holding the list of turns."""
    message_property_mappings: dict[str, str] = dataclasses.field(default_factory=lambda: {"role": "role", "content": "content"})
    """chat_template: turn keys, {role: KEY, content: KEY} (Axolotl >= 0.8)."""
    message_field_role: str | None = None
    """chat_template: older name of message_property_mappings.role."""
    message_field_content: str | None = None
    """chat_template: older name of message_property_mappings.content."""
    roles: dict[str, list[str]] | None = None
    """chat_template: template role -> the dataset's names for it (default: Axolotl's user/assistant/system/tool)."""
    roles_to_train: list[str] = dataclasses.field(default_factory=lambda: ["assistant"])
    """chat_template: template roles whose turns are trained on (Axolotl's default: assistant)."""
    train_on_eos: str = "turn"
    """chat_template: which end-of-turn / eos tokens are trained: "turn" (after trained turns, Axolotl's default),
    "all", "last" (the last turn's) or "none"."""
    drop_system_message: bool = False
    """chat_template: drop a leading system turn."""
    field_thinking: str = "reasoning_content"
    """chat_template: the turn key holding its reasoning text (Axolotl's default reasoning_content); given to the
    template under template_thinking_key, and trained with the turn's content where the template renders it."""
    template_thinking_key: str = "reasoning_content"
    """chat_template: the key the template reads the reasoning from (gpt-oss's reads "thinking")."""
    field_chosen: str = "chosen"
    """rl: dpo: the column holding the preferred answer (data/preference.py)."""
    field_rejected: str = "rejected"
    """rl: dpo: the column holding the other answer."""
    step_separator: str = "\n"
    """stepwise_supervised: the text after each step; a step's label sits on its last token (data/reward.py)."""
    max_completion_length: int | None = None
    """stepwise_supervised: cut the steps' tokens to this many. Default: no cut (sequence_len still applies)."""
    train_on_last_step_only: bool = False
    """stepwise_supervised: label the last step only."""
    name: str | None = None
    """The dataset's configuration, e.g. "main": a hub dataset's when streamed; otherwise a configuration of a local
    dataset folder (one downloaded from the hub: its README.md lists the configurations, or a subfolder per name)."""
    skip: int = 0
    """Streamed data only: records left out at the stream's start (Axolotl's pretraining_dataset skip)."""
    base_dir: str = ""
    """Directory relative paths are resolved against (the working directory, as in Axolotl); not a YAML key."""

    @property
    def role_map(self) -> dict[str, str]:
        """dataset role name -> template role."""
        roles = self.roles or DEFAULT_ROLES
        return {name: role for role, names in roles.items() for name in names}

    @property
    def role_key(self) -> str:
        return self.message_field_role or self.message_property_mappings.get("role", "role")

    @property
    def content_key(self) -> str:
        return self.message_field_content or self.message_property_mappings.get("content", "content")

    @property
    def text_field(self) -> str:
        return self.field or "text"

    @property
    def resolved(self) -> Path:
        path = Path(self.path).expanduser()
        return path if path.is_absolute() else Path(self.base_dir) / path


_KEYS = {f.name for f in dataclasses.fields(DatasetSpec)} - {"base_dir"}
# Keys Axolotl accepts in an entry that change nothing here when left at their default.
_INERT = {"shards": None, "revision": None, "trust_remote_code": False,
          "preprocess_shards": None, "conversation": None, "train_on_split": None}
_NAMED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def names_function(kind: Any) -> bool:
    """A `type` (or reward function) written module.function: a user function, as Axolotl's RL loaders read it."""
    return isinstance(kind, str) and bool(_NAMED.match(kind))


def dataset_specs(path, datasets: Any, dataset_path: Any = None, problems: list[str] | None = None,
                  transforms: bool = False):
    """The `datasets:` list (or our older `dataset_path:` string) of the YAML file `path`, checked. With
    `problems`, each bad entry's message is appended there (and the entry left out) instead of raised. With
    `transforms` (rl: grpo), a `type` may name a user function, module.function (grpo.py checks it)."""
    problem = None
    if (datasets is None) == (dataset_path is None):
        problem = ("give the data as 'datasets: [{path: data.jsonl, type: completion}]' (or 'dataset_path: "
                   "data.txt'), exactly one of them")
    elif dataset_path is not None:
        datasets = [{"path": dataset_path}]
    if problem is None and (not isinstance(datasets, list) or not datasets):
        problem = "datasets must be a non-empty list of {path, type, ...} mappings"
    if problem is not None:
        if problems is None:
            raise ConfigError(f"{path}: {problem}")
        problems.append(problem)
        return []
    base, specs = os.getcwd(), []
    for i, entry in enumerate(datasets):
        try:
            specs.append(_spec(path, i, entry, base, transforms))
        except ConfigError as err:
            if problems is None:
                raise
            problems.append(str(err).removeprefix(f"{path}: "))
    return specs


def _spec(path, i: int, entry: Any, base: str, transforms: bool = False) -> DatasetSpec:
    entry = {"path": entry} if isinstance(entry, str) else entry
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise ConfigError(f"{path}: datasets[{i}] must be a mapping with a 'path' string")
    entry = dict(entry)
    for key, default in _INERT.items():
        if key in entry and entry.pop(key) not in (default, None):
            raise ConfigError(f"{path}: datasets[{i}].{key} is not supported by nd-parallel train; drop it (point "
                              "'path' at local files), or run the YAML with Axolotl and the nd_parallel plugin")
    unknown = [f"unknown key {key!r} in datasets[{i}]; {suggest(key, _KEYS)}" for key in entry if key not in _KEYS]
    if unknown:  # all of them, one line each (the one message)
        raise ConfigError(f"{path}: " + "\n  - ".join(unknown))
    kind = entry.get("type", "completion")
    if kind is None:  # Axolotl: `type:` left empty reads a dataset that is already tokenized
        kind = entry["type"] = "tokenized"
    known = isinstance(kind, str) and (kind in TYPES or TYPE_ALIASES.get(kind) or instructions.parse(kind)
                                       or kind in KTO_TYPES + DPO_TYPES + ORPO_TYPES  # rl's (rl_refusals pairs them)
                                       or kind in REWARD_TYPES or (transforms and names_function(kind)))
    if not known:
        fix = instructions.problem(kind) if isinstance(kind, str) else None
        if kind == "sharegpt":
            fix = ("type: chat_template with field_messages: conversations and message_property_mappings: {role: "
                   "from, content: value}")
        fix = fix or f"one of {', '.join(TYPES + INSTRUCTION_TYPES)}"
        raise ConfigError(f"{path}: datasets[{i}].type={kind!r} is not supported by nd-parallel train; use {fix}, "
                          "or run the YAML with Axolotl (with the nd_parallel plugin for a supervised format; "
                          "preference, reward and RL formats are not checked under nd_parallel)")
    entry["type"] = TYPE_ALIASES.get(kind) or kind
    spec, issues = DatasetSpec(**entry, base_dir=base), []
    if spec.ds_type is not None and spec.ds_type not in set(DS_TYPES.values()):
        issues.append(f"datasets[{i}].ds_type={spec.ds_type!r}; use one of "
                      f"{', '.join(sorted(set(DS_TYPES.values())))} (or leave it out: the extension decides)")
    issues += _stepwise_issues(spec, i)
    for key in ("field_thinking", "template_thinking_key"):
        if not isinstance(getattr(spec, key), str):
            issues.append(f"datasets[{i}].{key}={getattr(spec, key)!r}; write the turn key, e.g. thinking")
    if spec.train_on_eos not in EOS_OPTIONS:
        issues.append(f"datasets[{i}].train_on_eos={spec.train_on_eos!r}; use one of {', '.join(EOS_OPTIONS)}")
    if parse_split(spec.split) is None:
        issues.append(f"datasets[{i}].split={spec.split!r} is not a split name or a slice; write e.g. 'train', "
                      "'train[:20%]', 'train[10:100]'")
    if issues:  # every problem of the entry, one line each (config.py lists them with the others)
        raise ConfigError(f"{path}: " + "\n  - ".join(issues))
    return spec


EOS_OPTIONS = ("turn", "all", "last", "none")


def _stepwise_issues(spec: DatasetSpec, i: int) -> list[str]:
    out = [] if isinstance(spec.step_separator, str) and spec.step_separator else [
        f"datasets[{i}].step_separator={spec.step_separator!r}; write the text between steps, e.g. \"\\n\""]
    length = spec.max_completion_length
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        out.append(f"datasets[{i}].max_completion_length={length!r}; write a number of tokens >= 1 or leave it out")
    if not isinstance(spec.train_on_last_step_only, bool):
        out.append(f"datasets[{i}].train_on_last_step_only={spec.train_on_last_step_only!r}; use true or false")
    return out


_SPLIT = re.compile(r"^(\w+)(?:\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\])?$")


def parse_split(split: str):
    """(split name, start, stop) with start/stop None, an int or a "N%" string; None when not a split."""
    m = _SPLIT.match(split) if isinstance(split, str) else None
    return None if m is None else (m.group(1), m.group(2), m.group(3))


def slice_rows(split: str, rows: int, where: str) -> range | None:
    """The rows `split`'s slice selects out of `rows` (None: no slice); refused when a bound is past the rows."""
    _, start, stop = parse_split(split)
    if start is None and stop is None and "[" not in split:
        return None

    def bound(value, default):
        if value is None:
            return default
        n = round(rows * int(value[:-1]) / 100) if value.endswith("%") else int(value)
        if abs(int(value.rstrip("%"))) > (100 if value.endswith("%") else rows):
            raise ConfigError(f"{where}: split={split!r} asks for row {value}, but the data has {rows} rows; "
                              f"use a bound within {rows} rows (or a percentage) in the datasets entry's 'split:'")
        return n if n >= 0 else rows + n

    picked = range(bound(start, 0), bound(stop, rows))
    if len(picked) == 0:
        raise ConfigError(f"{where}: split={split!r} selects no rows of its {rows}; widen the slice in 'split:'")
    return picked


# ----------------------------------------------------------------------------------------------- reading
def _files(spec: DatasetSpec) -> list[Path]:
    root = spec.resolved
    if spec.data_files is not None:
        names = [spec.data_files] if isinstance(spec.data_files, str) else list(spec.data_files)
        base = root if root.is_dir() else root.parent
        files = [Path(n) if Path(n).is_absolute() else base / n for n in names]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix in DS_TYPES and p.is_file())
    else:
        files = [root]
    for file in files:
        if not file.is_file():
            raise ConfigError(f"dataset file {str(file)!r} does not exist (datasets entry path={spec.path!r}); "
                              "fix the path (relative paths start at the YAML's directory) or create the file")
    if not files:
        raise ConfigError(f"dataset directory {str(root)!r} holds no {'/'.join(DS_TYPES)} files; point "
                          "'path' at the files, or list them in data_files")
    return files


def load_source(spec: DatasetSpec, cache_dir: str):
    """The spec's split as a `datasets.Dataset` (plus a `_source` label per record for error messages)."""
    import datasets

    if spec.name is not None:
        return _configuration(spec, cache_dir)
    saved = _saved_split(spec)
    if saved is not None:
        return _sliced(saved, spec, str(spec.resolved)), str(spec.resolved)
    kind, files = _file_format(spec)
    try:
        loaded = datasets.load_dataset(kind, data_files={"train": [str(f) for f in files]}, split="train",
                                       cache_dir=cache_dir)
    except Exception as err:  # the reader's own message, with the file named
        raise ConfigError(f"cannot read {', '.join(map(str, files))} as {kind}: {err}") from None
    where = ", ".join(map(str, files))
    return _sliced(loaded, spec, where), where


def _configuration(spec: DatasetSpec, cache_dir: str):
    """A local dataset folder's configuration ``name``: the configurations its README.md declares (a hub dataset's
    files, downloaded), else the files of its subfolder ``name``."""
    import datasets

    root, where = spec.resolved, f"{spec.resolved} (configuration {spec.name!r})"
    readme = root / "README.md"
    if readme.is_file() and "config_name:" in readme.read_text(encoding="utf-8", errors="ignore"):
        try:
            loaded = datasets.load_dataset(str(root), name=spec.name, split=parse_split(spec.split)[0],
                                           cache_dir=cache_dir)
        except Exception as err:  # datasets' own message: the configurations or splits it has
            raise ConfigError(f"cannot read {where}: {err}; fix 'name:' / 'split:' of that datasets entry") from None
        return _sliced(loaded, spec, where), where
    if not (root / spec.name).is_dir():
        raise ConfigError(f"datasets entry path={spec.path!r} with name={spec.name!r}: {root} is not a dataset folder "
                          f"with that configuration (no README.md listing configurations, no subfolder "
                          f"{spec.name!r}); point 'path' at the data files and drop 'name', or set streaming: true "
                          "for a hub dataset")
    inner = dataclasses.replace(spec, path=str(root / spec.name), name=None)
    loaded, _ = load_source(inner, cache_dir)
    return loaded, where


def _saved_split(spec: DatasetSpec):
    """The split of a `save_to_disk` folder at spec.path (None when spec.path names data files)."""
    import datasets

    root = spec.resolved
    if not (root.is_dir() and spec.data_files is None and ((root / "dataset_info.json").is_file()
                                                           or (root / "dataset_dict.json").is_file())):
        return None
    loaded = datasets.load_from_disk(str(root))
    name = parse_split(spec.split)[0]
    if isinstance(loaded, datasets.DatasetDict):
        if name not in loaded:
            raise ConfigError(f"{root}: no split {name!r} (it has {', '.join(loaded)}); set 'split:'")
        loaded = loaded[name]
    return loaded


def _file_format(spec: DatasetSpec) -> tuple[str, list[Path]]:
    """(the `datasets` reader for spec's files, the files); one format per entry, else refused."""
    files = _files(spec)  # a path that does not exist is refused here, naming it
    kinds = {spec.ds_type or DS_TYPES.get(f.suffix) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise ConfigError(f"{spec.path}: cannot tell the format of {', '.join(map(str, files))}; set ds_type: "
                          "json, parquet, csv, arrow or text, and keep one format per datasets entry")
    return kinds.pop(), files


def _sliced(loaded, spec: DatasetSpec, where: str):
    picked = slice_rows(spec.split, len(loaded), where)
    return loaded if picked is None else loaded.select(picked)


def open_stream(spec: DatasetSpec):
    """The spec's records as a `datasets.IterableDataset` (streaming=True: read as they are iterated, never the whole
    corpus first), plus where they come from. An existing local path is read from its files (or its `save_to_disk`
    folder); any other path is a hub dataset name, opened with its `name` and `split` as Axolotl opens it."""
    import datasets

    root = spec.resolved
    if root.exists() or Path(spec.path).suffix in DS_TYPES or spec.path.startswith((".", "/", "~")):
        saved = _saved_split(spec)
        if saved is not None:
            return saved.to_iterable_dataset(), str(root)
        kind, files = _file_format(spec)
        stream = datasets.load_dataset(kind, data_files={"train": [str(f) for f in files]}, split="train",
                                       streaming=True)
        return stream, ", ".join(map(str, files))
    try:
        stream = datasets.load_dataset(spec.path, name=spec.name, split=spec.split, data_files=spec.data_files,
                                       streaming=True)
    except Exception as err:  # the hub's own message (no network, no such dataset, split or configuration)
        raise ConfigError(f"cannot stream the dataset {spec.path!r} (name={spec.name!r}, split={spec.split!r}): "
                          f"{err}; check the hub name, its configuration and split, or point 'path' at local files"
                          ) from None
    return stream, f"{spec.path} ({spec.name or 'default'}, {spec.split}, streamed)"
