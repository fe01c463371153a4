"""HF safetensors from a checkpoint written by ``save_state``, offline: one process, no process group, one tensor
in memory at a time (``nd-parallel export``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..format import (
    CONFIG,
    DCP_DIR,
    CheckpointError,
    check_shard_files,
    quiet_single_process,
    read_dcp_metadata,
    read_marker,
    safe_reader,
)
from ..names import MODEL
from .writer import GENERATION, Entry, ShardedWriter, natural_key, shard_size


def read_tensors(ckpt_dir, prefix: str = MODEL):
    """Yield (key without ``prefix.``, full tensor) of a checkpoint one at a time, in natural name order; one
    process, no process group. Everything is checked first (marker, metadata, shard files)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..format import safe_load_planner

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
    writer = ShardedWriter(out_dir, order, shard_size(max_shard_size))
    for name, tensor in read_tensors(ckpt_dir, MODEL):
        writer.write(name, tensor)
        del tensor
    files = writer.close()
    shutil.copyfile(ckpt_dir / CONFIG, out_dir / CONFIG)
    if (ckpt_dir / GENERATION).is_file():
        shutil.copyfile(ckpt_dir / GENERATION, out_dir / GENERATION)
    return {"tensors": len(order), "bytes": writer.total, "files": files, "step": marker.get("optimizer_step"),
            "model_class": marker.get("model_class")}
