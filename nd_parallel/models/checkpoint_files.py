"""What a safetensors checkpoint holds, read from its headers only: key -> file, shape and dtype.

No tensor data is read here: ``read_headers`` opens each file for its header, so a damaged or incomplete
checkpoint fails before any process group exists, and ``resolve_dtype`` picks the dtype transformers would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class PlainLoadNeeded(Exception):
    """The checkpoint or the arguments need transformers' own loader; the message says why."""


@dataclass
class Tensors:
    """What the safetensors headers say: checkpoint key -> file, shape and dtype."""

    files: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    @property
    def num_files(self) -> int:
        return len(set(self.files.values()))

    def element_size(self, key: str) -> int:
        """Bytes of one element of ``key`` as stored in the file."""
        return _DTYPE_BYTES.get(self.dtypes[key], 1)

    def nbytes(self, key: str) -> int:
        """Bytes of the whole tensor ``key`` as stored in the file."""
        numel = 1
        for n in self.shapes[key]:
            numel *= n
        return numel * self.element_size(key)


def read_headers(directory: str | Path) -> Tensors:
    """Key -> file/shape/dtype of a safetensors checkpoint, single file or sharded with an index."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'; the sharded checkpoint's index is damaged")
        listed = sorted(set(weight_map.values()))
    elif (directory / SINGLE_NAME).is_file():
        weight_map, listed = None, [SINGLE_NAME]
    else:
        raise PlainLoadNeeded(f"{directory} holds neither {SINGLE_NAME} nor {INDEX_NAME}")
    tensors = Tensors({}, {}, {})
    for name in listed:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"{index} lists {name}, which is missing from {directory}; the checkpoint is "
                                    "incomplete (an interrupted download or save?)")
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as err:  # safetensors checks the header against the file size
            raise ValueError(f"{path} is not a readable safetensors file ({err}); is it truncated?") from err
        with handle as f:
            for key in f.keys():
                piece = f.get_slice(key)
                tensors.files[key] = str(path)
                tensors.shapes[key] = tuple(piece.get_shape())
                tensors.dtypes[key] = piece.get_dtype()
    if weight_map is not None:
        absent = sorted(k for k, file in weight_map.items() if tensors.files.get(k) != str(directory / file))
        if absent:
            raise ValueError(f"{index} places {len(absent)} tensors in files that do not hold them "
                             f"(first: '{absent[0]}' in {weight_map[absent[0]]}); the checkpoint is damaged")
    return tensors


def resolve_dtype(dtype, config, tensors: Tensors) -> torch.dtype:
    """transformers' rule: None/"auto" -> the config's dtype, else the first floating tensor's; a name -> torch's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if getattr(config, "dtype", None) is not None:
            found = config.dtype
            return getattr(torch, found) if isinstance(found, str) else found
        first = next(iter(tensors.files.values()))
        floating = [d for k, d in tensors.dtypes.items() if tensors.files[k] == first and _DTYPES.get(d, torch.int8)
                    .is_floating_point]
        return _DTYPES[floating[0]] if floating else torch.get_default_dtype()
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise PlainLoadNeeded(f"dtype={dtype!r}")
