"""Writing Hugging Face safetensors one tensor at a time, and the order every rank walks the tensors in.

The file header is computed from names, shapes and dtypes alone; then each tensor arrives on its own (gathered
from its shards, or read from DCP), is appended to the open file and dropped, so no process ever holds the whole
model. The output is what ``save_pretrained`` writes: ``config.json`` (+ ``generation_config.json``),
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, and a tied
weight only under its source name (``from_pretrained`` re-ties the other from the config). One writer serves the
full-model export, the merged-adapter export and the offline export.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..format import CONFIG

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
GENERATION = "generation_config.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def natural_key(name: str):
    """model.layers.2 before model.layers.10 (the order save_pretrained's files read in)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def plan_files(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Consecutive entries grouped into files of at most ``max_shard_size`` bytes (a bigger tensor gets its own)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return [f for f in files if f]


def file_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class SafetensorsWriter:
    """Writes one safetensors file whose tensors arrive one at a time, in the declared order."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for e in entries:
            if e.dtype not in _DTYPES:
                raise NotImplementedError(f"{e.name}: dtype {e.dtype} has no safetensors name")
            header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned, as the reference writer does
        self.expected = list(entries)
        self.path = path
        self.file = open(path, "wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        e = self.expected.pop(0)
        if name != e.name or tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype:
            raise RuntimeError(f"{self.path}: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected {e}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.file.write(data.numpy().tobytes())

    def close(self) -> None:
        self.file.close()
        if self.expected:
            raise RuntimeError(f"{self.path}: {len(self.expected)} tensors were never written")


class ShardedWriter:
    """The files of one export: opens each file when its first tensor comes, writes the index at the end."""

    def __init__(self, out_dir: Path, entries: list[Entry], max_shard_size: int):
        self.out_dir = out_dir
        self.groups = plan_files(entries, max_shard_size)
        self.names = file_names(len(self.groups))
        self.file_of = {e.name: i for i, group in enumerate(self.groups) for e in group}
        self.current: SafetensorsWriter | None = None
        self.index = -1
        self.total = sum(e.nbytes for e in entries)
        _remove_stale(out_dir, set(self.names))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        i = self.file_of[name]
        if i != self.index:
            if self.current is not None:
                self.current.close()
            self.index = i
            self.current = SafetensorsWriter(self.out_dir / self.names[i], self.groups[i])
        self.current.write(name, tensor)

    def close(self) -> list[str]:
        if self.current is not None:
            self.current.close()
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {e.name: self.names[i] for i, g in enumerate(self.groups) for e in g}}
            (self.out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return self.names


def _remove_stale(out_dir: Path, keep: set[str]) -> None:
    """Weight files of an earlier export into the same directory would be read alongside the new ones."""
    for p in out_dir.iterdir():
        if (p.name == SINGLE or p.name == INDEX or _SHARD.match(p.name)) and p.name not in keep:
            p.unlink()


def shard_size(max_shard_size) -> int:
    """Bytes per file from a size such as \"10GB\" (Accelerate's and transformers' notation)."""
    from accelerate.utils import convert_file_size_to_int

    return convert_file_size_to_int(max_shard_size)


def write_model_config(hf_model, out_dir: Path) -> None:
    """config.json (with ``architectures``, as save_pretrained sets it) and generation_config.json if it generates."""
    config = copy.deepcopy(hf_model.config)
    config.architectures = [type(hf_model).__name__.removeprefix("FSDP")]  # fully_shard renames the class
    config.to_json_file(str(out_dir / CONFIG))
    if getattr(hf_model, "can_generate", lambda: False)() and getattr(hf_model, "generation_config", None):
        hf_model.generation_config.to_json_file(str(out_dir / GENERATION))
