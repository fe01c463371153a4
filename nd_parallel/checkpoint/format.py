"""The on-disk checkpoint: file names, atomic publication, retention, and every check made before loading.

A checkpoint directory written by ``accelerator.save_state`` under the plugin::

    ckpt/
      nd_parallel.json     written last, once every rank finished: format, step, layout, dataloader positions
      config.json          the model's HF config (``nd-parallel export`` needs nothing else)
      dcp/                 torch.distributed.checkpoint: .metadata + one __<rank>_0.distcp file per rank
      rng/rank_00000.safetensors ...   each rank's RNG states (safetensors: no pickle)

It is written into ``.<name>.incomplete`` beside the target and renamed to ``<name>`` only after a barrier
and the marker, so a save that dies half-way never replaces (or looks like) a good checkpoint.

Nothing here trusts the files: DCP's ``.metadata`` is a pickle, read with an unpickler that only accepts
DCP's own metadata classes; non-tensor values are read with ``torch.load(weights_only=True)``; keys, shapes
and the size of every shard file are checked against what the model expects before anything is loaded.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch

MARKER = "nd_parallel.json"
DCP_DIR = "dcp"
RNG_DIR = "rng"
CONFIG = "config.json"
FORMAT = "nd_parallel.checkpoint"
VERSION = 1
_INCOMPLETE = ".incomplete"
_AUTO_NAME = re.compile(r"^checkpoint_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file or value and the fix."""


# ------------------------------------------------------------------------------------------ publication
def temp_sibling(final: Path) -> Path:
    return final.parent / f".{final.name}{_INCOMPLETE}"


def is_incomplete_name(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(_INCOMPLETE)


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory to its final name (main process, after every rank finished)."""
    old = final.parent / f".{final.name}.replaced"
    if final.exists():
        # A directory cannot be renamed over a non-empty one: move the previous checkpoint aside first. Between
        # the two renames a crash leaves both directories beside the target (both names start with a dot).
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def auto_checkpoints(root: Path) -> list[Path]:
    """Complete ``checkpoint_<n>`` directories under ``root``, oldest (smallest n) first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _AUTO_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / MARKER).is_file()]


def apply_total_limit(root: Path, limit: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``limit`` (after the new one is published); returns them."""
    if limit is None:
        return []
    done = auto_checkpoints(root)
    removed = done[: max(0, len(done) - limit)]
    for path in removed:
        shutil.rmtree(path)
    return removed


# -------------------------------------------------------------------------------------- safe reading
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes, torch dtypes/layouts/memory formats and paths: a crafted ``.metadata``
    cannot make the loader call anything else."""

    def find_class(self, module, name):
        allowed = _DCP_METADATA_CLASSES.get(module, ())
        if name in allowed:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}: not part of a DCP metadata file")


def read_dcp_metadata(dcp_dir: Path):
    path = dcp_dir / ".metadata"
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the DCP metadata of this checkpoint was deleted or never written, so its shard "
            "files cannot be interpreted; load an earlier checkpoint")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path} is not a valid DCP metadata file ({err}); load an earlier checkpoint") from None


def safe_reader(dcp_dir: Path, metadata=None):
    """A DCP ``FileSystemReader`` that reads the metadata with the restricted unpickler (once)."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(self, "_nd_metadata", None) is None:
                self._nd_metadata = metadata if metadata is not None else read_dcp_metadata(Path(self.path))
                self.storage_data = self._nd_metadata.storage_data
            return self._nd_metadata

    return SafeReader(str(dcp_dir))


def safe_load_planner(**kwargs):
    """DCP's default load planner, except that non-tensor values are read with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner(**kwargs)


def quiet_single_process():
    """DCP warns on every call without a process group that it assumes one process: that is the intent here."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def quiet():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            yield

    return quiet()


# --------------------------------------------------------------------------------------------- checks
def _describe_dir(path: Path) -> str:
    files = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else []
    return ", ".join(files) or "nothing"


def read_marker(path: Path) -> dict:
    """The completion marker of a checkpoint directory, or an error that says what the directory is instead."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist; pass the directory save_state wrote")
    marker = path / MARKER
    if is_incomplete_name(path) or (not marker.is_file() and (path / DCP_DIR).is_dir()):
        good = [p.name for p in auto_checkpoints(path.parent)]
        raise CheckpointError(
            f"{path} was left by an interrupted save (it has no {MARKER} completion marker); it is incomplete "
            f"and cannot be loaded. Load the previous checkpoint instead"
            + (f" (complete ones beside it: {', '.join(good)})" if good else ""))
    if not marker.is_file():
        if any(path.glob("*.safetensors")) and (path / CONFIG).is_file():
            raise CheckpointError(
                f"{path} holds model weights only (HF safetensors, as accelerator.save_model or save_pretrained "
                "write them), not a training state: a full resume needs the directory accelerator.save_state "
                f"wrote. To start a new run from these weights, load them with plugin.from_pretrained('{path}')")
        raise CheckpointError(
            f"{path} has no {MARKER}: it is not a checkpoint written by accelerator.save_state under nd_parallel "
            f"(it contains: {_describe_dir(path)})")
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{marker} is unreadable ({err}); the checkpoint is damaged, load an earlier "
                              "one") from None
    if data.get("format") != FORMAT or not isinstance(data.get("version"), int):
        raise CheckpointError(f"{marker} is not an nd_parallel checkpoint marker (format={data.get('format')!r})")
    if data["version"] > VERSION:
        raise CheckpointError(f"{path} was written by a newer nd_parallel (format version {data['version']}, this "
                              f"one reads up to {VERSION}); upgrade nd_parallel to load it")
    return data


def check_shard_files(dcp_dir: Path, metadata) -> None:
    """Every file the metadata points into exists and is long enough (a truncated copy fails here, not half-way)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = dcp_dir / name
        if not path.is_file():
            raise CheckpointError(f"shard file {path} is missing (the metadata lists it); the checkpoint is "
                                  "incomplete: copy the whole directory again or load an earlier checkpoint")
        actual = path.stat().st_size
        if actual < size:
            raise CheckpointError(f"shard file {path} is truncated: {actual} bytes, the metadata needs at least "
                                  f"{size}; copy the whole directory again or load an earlier checkpoint")


def _listing(names, limit: int = 6) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_keys(metadata, expected: dict[str, tuple | None], prefix: str, where: Path, what: str) -> None:
    """Keys under ``prefix.`` in the checkpoint equal ``expected`` (key -> global shape or None for non-tensors)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix + ".")}
    strip = len(prefix) + 1
    missing = [k[strip:] for k in expected if k not in stored]
    unexpected = [k[strip:] for k in stored if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_listing(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in this {what}: {_listing(unexpected)}")
        raise CheckpointError(
            f"{where} does not match the {what} being loaded ({'; '.join(parts)}). It was saved from a different "
            f"model{' or optimizer' if what == 'optimizer' else ''}; load it into the same architecture "
            f"(see {where.parent / CONFIG if where.name == DCP_DIR else where / CONFIG})")
    wrong = []
    for key, shape in expected.items():
        meta = stored[key]
        if shape is not None and isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(shape):
            wrong.append(f"{key[strip:]} is {tuple(meta.size)} in the checkpoint, {tuple(shape)} here")
    if wrong:
        raise CheckpointError(f"{where}: shapes differ from the {what} being loaded: {'; '.join(wrong[:6])}. It was "
                              "saved from a model of another size; build the model from the checkpoint's config.json")
