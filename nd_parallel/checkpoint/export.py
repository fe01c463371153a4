"""Hugging Face safetensors from a sharded model (``accelerator.save_model``) or a DCP checkpoint (offline).

Both write tensor by tensor: the file header is computed from names, shapes and dtypes alone, then each
tensor is gathered (or read from the DCP shards) on its own, appended to the open file and dropped, so no
process ever holds the whole model. The output is what ``save_pretrained`` writes: ``config.json``
(+ ``generation_config.json``), ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, and a tied weight only under its source name (``from_pretrained`` re-ties
the other from the config).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .format import (
    CONFIG,
    DCP_DIR,
    CheckpointError,
    check_shard_files,
    quiet_single_process,
    read_dcp_metadata,
    read_marker,
    safe_reader,
)
from .names import MODEL, hf_modules, named_state

logger = logging.getLogger("nd_parallel")

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


def _size(max_shard_size) -> int:
    from accelerate.utils import convert_file_size_to_int

    return convert_file_size_to_int(max_shard_size)


def write_model_config(hf_model, out_dir: Path) -> None:
    """config.json (with ``architectures``, as save_pretrained sets it) and generation_config.json if it generates."""
    config = copy.deepcopy(hf_model.config)
    config.architectures = [type(hf_model).__name__.removeprefix("FSDP")]  # fully_shard renames the class
    config.to_json_file(str(out_dir / CONFIG))
    if getattr(hf_model, "can_generate", lambda: False)() and getattr(hf_model, "generation_config", None):
        hf_model.generation_config.to_json_file(str(out_dir / GENERATION))


# ------------------------------------------------------------------------------------------------ online
def _entries(local: dict, distributed: bool) -> tuple[list[Entry], dict[str, list[int]]]:
    """Every rank's tensors (name, global shape, dtype) in one order, and which ranks hold each."""
    mine = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in local.items()
            if isinstance(v, torch.Tensor)]
    everyone = [mine]
    if distributed:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    holders: dict[str, list[int]] = {}
    entries: dict[str, Entry] = {}
    for rank, items in enumerate(everyone):
        for name, shape, dtype in items:
            holders.setdefault(name, []).append(rank)
            entries[name] = Entry(name, shape, getattr(torch, dtype))
    return [entries[n] for n in sorted(entries, key=natural_key)], holders


def gather_one_by_one(accelerator, local: dict, entries: list[Entry], holders: dict[str, list[int]]):
    """Yield (name, full tensor) on the main process, one at a time; every rank must iterate it to the end.

    A sharded tensor is made whole over its own mesh (the ranks of its pipeline stage); a stage without the
    main process sends it from its first rank. Every rank walks the same order, so the collectives of each
    stage and the send/receive pairs line up.
    """
    main = accelerator.is_main_process
    distributed = dist.is_initialized() and accelerator.num_processes > 1
    me = dist.get_rank() if distributed else 0
    for e in entries:
        tensor = None
        if e.name in local:
            value = local[e.name]
            tensor = value.full_tensor() if hasattr(value, "full_tensor") else value  # collective over its mesh
        lead = holders[e.name][0]
        if main and tensor is None:
            tensor = torch.empty(e.shape, dtype=e.dtype, device=accelerator.device)
            dist.recv(tensor, src=lead)
        elif not main and me == lead and 0 not in holders[e.name]:
            dist.send(tensor.contiguous(), dst=0)
        if main:
            yield e.name, tensor
        del tensor


def full_state(accelerator, model, optimizer=None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's canonical state (``model.<HF name>``, ``optim.state.<HF name>.exp_avg``,
    ...) made whole, on the CPU of the main process (empty elsewhere). A collective: every rank calls it."""
    named = named_state(model, optimizer)
    distributed = dist.is_initialized() and accelerator.num_processes > 1
    entries, holders = _entries(named.flat, distributed)
    return {k: v.detach().cpu().clone() for k, v in gather_one_by_one(accelerator, named.flat, entries, holders)}


def save_model(plugin, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True,
               merge_adapter: bool = False) -> Path:
    """``accelerator.save_model`` under the plugin: every rank takes part, the main process writes.

    A PEFT model writes its adapter, or with ``merge_adapter=True`` the merged model (adapter.py)."""
    from nd_parallel.models.peft import peft_wrapper

    if not safe_serialization:
        raise ValueError("safe_serialization=False would write pickled weights; nd_parallel writes safetensors "
                         "only: drop the argument")
    accelerator = plugin.accelerator
    out_dir = Path(os.path.expanduser(str(save_directory)))
    if out_dir.is_file():
        raise ValueError(f"save_model: {out_dir} is a file; pass a directory")
    if merge_adapter and peft_wrapper(model) is None:
        raise ValueError(f"save_model(merge_adapter=True): {type(model).__name__} carries no PEFT adapter; "
                         "drop merge_adapter")
    if peft_wrapper(model) is not None:
        from .adapter import save_adapter, save_merged

        return save_merged(plugin, model, out_dir, max_shard_size) if merge_adapter else save_adapter(
            plugin, model, out_dir)
    main = accelerator.is_main_process
    distributed = dist.is_initialized() and accelerator.num_processes > 1
    local = {k[len(MODEL) + 1:]: v for k, v in named_state(model).flat.items()}
    order, holders = _entries(local, distributed)
    writer = None
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        writer = ShardedWriter(out_dir, order, _size(max_shard_size))
    for name, tensor in gather_one_by_one(accelerator, local, order, holders):
        writer.write(name, tensor)
    if main:
        files = writer.close()
        write_model_config(hf_modules(model)[1], out_dir)
        logger.info("saved %s (%d tensors in %d files)", out_dir, len(order), len(files))
    if distributed:
        dist.barrier()
    return out_dir


# ----------------------------------------------------------------------------------------------- offline
def read_tensors(ckpt_dir, prefix: str = MODEL):
    """Yield (key without ``prefix.``, full tensor) of a checkpoint one at a time, in natural name order; one
    process, no process group. Everything is checked first (marker, metadata, shard files)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .format import safe_load_planner

    ckpt_dir = Path(ckpt_dir)
    read_marker(ckpt_dir)
    dcp_dir = ckpt_dir / DCP_DIR
    metadata = read_dcp_metadata(dcp_dir)
    check_shard_files(dcp_dir, metadata)
    keys = [k for k, m in metadata.state_dict_metadata.items()
            if k.startswith(prefix + ".") and isinstance(m, TensorStorageMetadata)]
    reader = safe_reader(dcp_dir, metadata)
    for key in sorted(keys, key=natural_key):
        meta = metadata.state_dict_metadata[key]
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with quiet_single_process():
            dcp.load({key: tensor}, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
        yield key[len(prefix) + 1:], tensor


def export_checkpoint(ckpt_dir, out_dir, max_shard_size="10GB") -> dict:
    """HF safetensors from a checkpoint written by ``save_state``: one process, no process group, one tensor in
    memory at a time. Returns a summary (tensors, bytes, files)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    marker = read_marker(ckpt_dir)
    if not (ckpt_dir / CONFIG).is_file():
        raise CheckpointError(f"{ckpt_dir / CONFIG} is missing; the export needs the model's config: copy it from "
                              "the model the run started from")
    metadata = read_dcp_metadata(ckpt_dir / DCP_DIR)
    order = [Entry(k[len(MODEL) + 1:], tuple(m.size), m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if k.startswith(MODEL + ".") and isinstance(m, TensorStorageMetadata)]
    if not order:
        raise CheckpointError(f"{ckpt_dir} holds no model tensors")
    order.sort(key=lambda e: natural_key(e.name))
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(out_dir, order, _size(max_shard_size))
    for name, tensor in read_tensors(ckpt_dir, MODEL):
        writer.write(name, tensor)
        del tensor
    files = writer.close()
    shutil.copyfile(ckpt_dir / CONFIG, out_dir / CONFIG)
    if (ckpt_dir / GENERATION).is_file():
        shutil.copyfile(ckpt_dir / GENERATION, out_dir / GENERATION)
    return {"tensors": len(order), "bytes": writer.total, "files": files, "step": marker.get("optimizer_step"),
            "model_class": marker.get("model_class")}
