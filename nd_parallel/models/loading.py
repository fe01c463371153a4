"""Memory-efficient loading: the model is built without weights, and each rank reads only what it will own.

``build_meta_model`` builds a causal LM from its config on the meta device (accelerate's
``init_empty_weights(include_buffers=False)``): parameters have shapes and dtypes but no storage, while buffers
are still computed on the CPU by the model's own ``__init__``, so non-persistent buffers (rotary ``inv_freq``,
embedding scales) get the values a normal build gives. Only the safetensors *headers* are read there: every
parameter is matched to its checkpoint key (through transformers' own key renamings) and its shape checked,
so a wrong checkpoint fails before any process group exists.

At ``accelerator.prepare`` the plugin splits and shards the meta model exactly as it would a real one (PP
stages, TP, FSDP/HSDP all work on meta tensors), then ``load_local_shards`` gives every parameter storage on
the device (``to_empty``) and fills each rank's local piece from ``safe_open(...).get_slice(key)[box]``, where
``box`` is the piece's place in the full tensor (``compute_local_shape_and_global_offset``, which also knows the
``_StridedShard`` placements of FSDP over TP). Reads go in row blocks of ~16 MiB of the file, each through its
own ``safe_open``, so the memory-mapped pages of one block leave the process before the next is read: a rank's
peak is about its own shards plus one block, not the model.

The values equal those of a plain ``from_pretrained``: the same bytes from the same file, cast to the
parameter's dtype the way transformers casts them. Where that cannot be promised (weights that transformers
*converts* on load, such as MoE experts stacked into one tensor; fp32-kept modules; non-safetensors files), the
plugin falls back to the plain path with a warning.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
ATTR = "_nd_parallel_checkpoint"  # where a meta-built model keeps the description of its checkpoint

# Reads go in blocks of about this many bytes of the file, each mapped and unmapped on its own (read_into).
READ_BLOCK_BYTES = 16 * 2**20

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


@dataclass
class LazyCheckpoint:
    """Attached to a meta-built model: where each of its tensors lives in the checkpoint."""

    directory: str
    tensors: Tensors
    names: dict[str, str]  # model state-dict name (every alias of a tied weight) -> checkpoint key
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys the model has no place for
    # Tensors that are not in the checkpoint but known in full on every rank (a fresh PEFT adapter's init):
    # model name -> full tensor; each rank copies its own box of it, like a checkpoint read.
    initial: dict[str, torch.Tensor] = field(default_factory=dict)

    def initial_tensors(self) -> list[torch.Tensor]:
        return [self.initial[k] for k in sorted(self.initial)]


@dataclass
class LoadReport:
    """What ``load_local_shards`` read on this rank (bytes as stored in the checkpoint)."""

    tensors: int = 0
    bytes_read: int = 0
    bytes_total: int = 0  # the whole checkpoint, for the ratio in the log line


# ------------------------------------------------------------------------------------------ checkpoint side
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


# ----------------------------------------------------------------------------------------------- model side
def _split_kwargs(path, hf_kwargs: dict):
    """(config, dtype argument, model kwargs, key mapping), or PlainLoadNeeded for keywords only the plain path
    knows (device_map, quantization_config, tp_plan, variant, ...); config attributes are overrides, as in
    from_pretrained."""
    from transformers import AutoConfig

    kwargs = dict(hf_kwargs)
    dtype = kwargs.pop("dtype", None)
    dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
    model_kwargs = {k: kwargs.pop(k) for k in ("attn_implementation", "trust_remote_code") if k in kwargs}
    key_mapping = kwargs.pop("key_mapping", None)
    config = kwargs.pop("config", None)
    if config is None:
        trust = model_kwargs.get("trust_remote_code", False)  # never True unless the user asked for it
        config, kwargs = AutoConfig.from_pretrained(path, return_unused_kwargs=True, trust_remote_code=trust,
                                                    **kwargs)
    if kwargs:
        raise PlainLoadNeeded(f"from_pretrained arguments {sorted(kwargs)}")
    return config, dtype, model_kwargs, key_mapping


def _weight_transforms(model: nn.Module, key_mapping):
    """transformers' renamings and converters for this model (4.x has none: identity)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # older transformers: checkpoint keys are module names
        return [], [], []
    try:
        mapping = get_model_conversion_mapping(model, key_mapping)
    except TypeError as err:  # another transformers 5.x signature: its own loader knows it
        raise PlainLoadNeeded(f"transformers' conversion mapping API is not the one known here ({err})") from err
    return (mapping, [m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def _rename(key: str, renamings, converters, prefix: str, expected: dict) -> tuple[str, bool]:
    """The model name a checkpoint key loads into, and whether a converter (not a plain rename) is needed."""
    try:
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        rename_source_key = None
    if rename_source_key is not None:
        try:
            renamed, converter = rename_source_key(key, renamings, converters, prefix, expected)
        except TypeError as err:
            raise PlainLoadNeeded(f"transformers' key renaming API is not the one known here ({err})") from err
        if renamed not in expected and key in expected:
            renamed, converter = key, None  # transformers keeps a key that already names a parameter
        return renamed, converter is not None
    # Without conversion mappings only the base-model prefix may differ (a base-model checkpoint).
    if key not in expected and prefix and f"{prefix}.{key}" in expected:
        return f"{prefix}.{key}", False
    if key not in expected and prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in expected:
        return key[len(prefix) + 1:], False
    return key, False


def match_checkpoint(model: nn.Module, tensors: Tensors, key_mapping=None) -> LazyCheckpoint:
    """Map every parameter and persistent buffer of ``model`` to its checkpoint key, checking shapes.

    Raises ``PlainLoadNeeded`` where transformers would convert tensors on load, and ``ValueError`` for a
    checkpoint that does not fit the model (missing parameters, wrong shapes), naming the first offender.
    """
    expected = model.state_dict()  # meta tensors: names and shapes only; tied weights appear under every name
    mapping, renamings, converters = _weight_transforms(model, key_mapping)
    prefix = getattr(model, "base_model_prefix", "") or ""
    names, unexpected, converted = {}, [], []
    for key in sorted(tensors.files):
        target, needs_converter = _rename(key, renamings, converters, prefix, expected)
        if target not in expected:
            unexpected.append(key)
        elif needs_converter:
            converted.append(key)
        else:
            names[target] = key
    if converted:
        raise PlainLoadNeeded(f"{len(converted)} checkpoint tensors (first: '{converted[0]}') are converted by "
                              "transformers on load (merged/split), which is not read slice by slice")
    model._weight_conversions = [m for m in mapping if m.was_used()]  # as transformers keeps them for saving
    _fill_tied_names(model, names)
    missing = [n for n, t in expected.items() if n not in names and not _is_buffer_kept(model, n)]
    if missing:
        raise ValueError(
            f"{len(missing)} parameters of {type(model).__name__} are not in the checkpoint (first: '{missing[0]}'); "
            "a plain from_pretrained would initialise them randomly, which the memory-efficient path does not do. "
            "Use a checkpoint that holds them, or plugin.from_pretrained(path, memory_efficient=False)"
        )
    wrong = [(n, tuple(t.shape), tensors.shapes[names[n]]) for n, t in expected.items()
             if n in names and tuple(t.shape) != tensors.shapes[names[n]]]
    if wrong:
        name, want, got = wrong[0]
        raise ValueError(f"{len(wrong)} checkpoint tensors do not fit {type(model).__name__} (first: '{name}' has "
                         f"shape {got} in the checkpoint, the model expects {want}); is it a checkpoint of another "
                         "model or config?")
    return LazyCheckpoint("", tensors, names, unexpected)


def _fill_tied_names(model: nn.Module, names: dict[str, str]) -> None:
    """Every alias of a shared parameter reads the key of its first alias found (the embedding for a tied head,
    as transformers ties the head to the embedding)."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for group in aliases.values():
        source = next((names[n] for n in group if n in names), None)
        if source is not None:
            for n in group:
                names[n] = source


def _is_buffer_kept(model: nn.Module, name: str) -> bool:
    """A persistent buffer the checkpoint lacks keeps the value the model's __init__ computed."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return leaf in module._buffers


def build_meta_model(path: str | Path, **hf_kwargs) -> nn.Module:
    """A causal LM with meta parameters, real buffers, and a ``LazyCheckpoint`` describing where its weights are.

    Raises ``PlainLoadNeeded`` where only transformers' own loader gives the right model.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    directory = Path(path)
    if not directory.is_dir():
        raise PlainLoadNeeded(f"'{path}' is not a local directory (download it first, e.g. `hf download`)")
    tensors = read_headers(directory)
    config, dtype, model_kwargs, key_mapping = _split_kwargs(str(directory), hf_kwargs)
    dtype = resolve_dtype(dtype, config, tensors)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    # init_empty_weights re-creates every parameter it registers, which undoes the tie made inside __init__.
    model.tie_weights()
    if getattr(model, "_get_dtype_plan", None) and model._get_dtype_plan(dtype):
        raise PlainLoadNeeded(f"{type(model).__name__} keeps some modules in fp32 when loaded as {dtype}")
    lazy = match_checkpoint(model, tensors, key_mapping)
    lazy.directory = str(directory)
    # Stale buffers old checkpoints carry, and the model's own ignore list, are dropped silently as transformers does.
    ignore = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []), r"rotary_emb\.inv_freq",
              r"(^|\.)position_ids$"]
    unexpected = [k for k in lazy.unexpected if not any(re.search(p, k) for p in ignore)]
    if unexpected:
        logger.warning("%d checkpoint tensors have no place in %s and are not read (first: '%s')",
                       len(unexpected), type(model).__name__, unexpected[0])
    model.config.name_or_path = str(path)
    if (directory / "generation_config.json").is_file() and getattr(model, "generation_config", None) is not None:
        model.generation_config = GenerationConfig.from_pretrained(directory)
    model.eval()  # as from_pretrained returns it
    setattr(model, ATTR, lazy)
    return model


def reads_whole_model(config) -> str | None:
    """Why every rank must hold the whole model before it is split (None: it need not).

    DeepSpeed's pipeline engine builds its own modules from a real model, and profile balancing times the
    whole model's layers on every rank; both then read the full checkpoint on every rank, like the plain path.
    """
    if config.pp_size > 1 and config.pp_backend == "deepspeed":
        return "pp_backend='deepspeed' builds its stages from a materialised model"
    if config.pp_size > 1 and config.pp_balance == "profile":
        return "pp_balance='profile' times every layer on every rank"
    return None


def lazy_checkpoint(model: nn.Module) -> LazyCheckpoint | None:
    """The checkpoint a meta-built model still has to read, or None for a model with real weights."""
    return getattr(model, ATTR, None)


# -------------------------------------------------------------------------------------------- reading slices
def local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank stores for ``tensor`` and the box it covers in the full tensor.

    For a DTensor the box comes from its placements (Shard, Replicate, and the _StridedShard that FSDP puts
    over a TP-sharded dim: there FSDP chunks the TP shard again, so the piece is still one contiguous box).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    check_one_box(tensor.placements, tensor.device_mesh.shape)
    local = tensor.to_local()  # under no_grad: the storage FSDP / TP hold, written in place
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"local shard of shape {tuple(local.shape)} does not match the {tuple(shape)} its "
                           f"placements {tensor.placements} give for {tuple(tensor.shape)}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def check_one_box(placements, mesh_shape) -> None:
    """Refuse placements whose local piece is not one contiguous box (the offset would not describe it).

    Plain Shards nest: each chunks the piece the ones before it left, so the piece stays a box. FSDP over
    TP writes ``_StridedShard(d, split_factor=k)`` on the dp dim, meaning "chunk the TP shard again": a box
    too, exactly when k is the number of pieces the later Shard(d) dims cut d into.
    """
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    for i, p in enumerate(placements):
        if not isinstance(p, _StridedShard):
            continue
        later = [mesh_shape[j] for j in range(i + 1, len(placements))
                 if isinstance(placements[j], Shard) and not isinstance(placements[j], _StridedShard)
                 and placements[j].dim == p.dim]
        pieces = 1
        for n in later:
            pieces *= n
        if not later or p.split_factor != pieces:
            raise NotImplementedError(f"placements {tuple(placements)} do not leave each rank one contiguous box "
                                      "of the tensor, which slice reading needs; use memory_efficient=False")


def read_into(target: torch.Tensor, tensors: Tensors, key: str, block_bytes: int | None = None) -> int:
    """Copy this rank's box of checkpoint tensor ``key`` into ``target`` (a parameter or buffer, DTensor or not).

    The box is read in blocks of whole rows of about ``block_bytes`` of the file, each through its own
    ``safe_open``: the memory-mapped pages a block touched are unmapped (leave this process's RSS) before the
    next block is read. A column slice touches every page of its rows, so blocks are sized by the file's full
    rows, not by the slice. The copy casts to the target's dtype as transformers' ``tensor.to(dtype)`` does.
    Returns the bytes read (checkpoint dtype).
    """
    local, box = local_box(target)
    if local.numel() == 0:  # an uneven FSDP split can leave a rank nothing of a small tensor
        return 0
    file = tensors.files[key]
    if not box:  # a 0-d tensor has no slices
        with safe_open(file, framework="pt", device="cpu") as f:
            piece = f.get_tensor(key)
            local.copy_(piece)
            return piece.element_size()
    row_bytes = _DTYPE_BYTES.get(tensors.dtypes[key], 1)
    for n in tensors.shapes[key][1:]:
        row_bytes *= n
    rows, read = box[0], 0
    step = max(1, (block_bytes or READ_BLOCK_BYTES) // max(row_bytes, 1))
    for first in range(rows.start, rows.stop, step):
        last = min(first + step, rows.stop)
        with safe_open(file, framework="pt", device="cpu") as f:
            block = f.get_slice(key)[(slice(first, last), *box[1:])]  # a view of the mapped file
            local[first - rows.start:last - rows.start].copy_(block)
            read += block.numel() * block.element_size()
    return read


class _SwapOnConversion:
    """``to_empty`` keeps every Parameter object (swap_tensors) instead of creating new ones: the optimizer,
    FSDP and the pipeline's tied-weight sync already hold references to them."""

    def __enter__(self):
        self.before = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)

    def __exit__(self, *exc):
        torch.__future__.set_swap_module_params_on_conversion(self.before)


def load_local_shards(modules: list[nn.Module], lazy: LazyCheckpoint, device: torch.device) -> LoadReport:
    """Give ``modules`` (a parallelized meta-built model, or this rank's pipeline stages) storage on ``device``
    and fill every parameter and persistent buffer with this rank's piece of the checkpoint.

    Buffers computed by the model's ``__init__`` (rotary frequencies) are kept: ``to_empty`` would wipe them.
    No collective: every rank reads its own boxes.
    """
    kept = [{n: b for n, b in m.named_buffers(remove_duplicate=False) if not b.is_meta} for m in modules]
    with _SwapOnConversion():
        for module in modules:
            module.to_empty(device=device)
    report = LoadReport(bytes_total=sum(_nbytes(lazy.tensors, k) for k in set(lazy.names.values())))
    done: set[int] = set()
    with torch.no_grad():
        for module, buffers in zip(modules, kept):
            for name, param in module.named_parameters(remove_duplicate=False):
                if id(param) in done:  # a tied weight: one parameter under two names
                    continue
                done.add(id(param))
                if name in lazy.initial:
                    local, box = local_box(param)
                    local.copy_(lazy.initial[name][box])
                    report.tensors += 1
                    continue
                if name not in lazy.names:
                    raise RuntimeError(
                        f"parameter '{name}' has no checkpoint tensor: it was not in the model from_pretrained built "
                        "on the meta device. To wrap it with PEFT, pass plugin.from_pretrained(path, peft_config=...); "
                        "for other changes before prepare, load it with plugin.from_pretrained(path, "
                        "memory_efficient=False)")
                report.bytes_read += read_into(param, lazy.tensors, lazy.names[name])
                report.tensors += 1
            for name, buf in module.named_buffers(remove_duplicate=False):
                if name in lazy.names:
                    report.bytes_read += read_into(buf, lazy.tensors, lazy.names[name])
                    report.tensors += 1
                elif name in buffers:
                    buf.copy_(buffers[name])
    for module in modules:
        if hasattr(module, ATTR):
            delattr(module, ATTR)
    share = report.bytes_read / max(report.bytes_total, 1)
    logger.info("loaded %d tensors from %d checkpoint files: this rank read %.1f of %.1f MiB (%.0f%%)",
                report.tensors, lazy.tensors.num_files, report.bytes_read / 2**20, report.bytes_total / 2**20,
                100 * share)
    return report


def _nbytes(tensors: Tensors, key: str) -> int:
    numel = 1
    for n in tensors.shapes[key]:
        numel *= n
    return numel * _DTYPE_BYTES.get(tensors.dtypes[key], 1)


# ------------------------------------------------------------------------------------------- the entry point
def from_pretrained(path, memory_efficient: bool = True, peft_config=None, **hf_kwargs) -> nn.Module:
    """The one way nd_parallel loads a causal LM (``NDParallelPlugin.from_pretrained`` is this).

    ``memory_efficient``: a meta-device model whose weights each rank reads at prepare, slice by slice; where that
    cannot equal ``AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)`` (``PlainLoadNeeded``) transformers'
    own loader runs instead, with a warning. ``peft_config``: the model wrapped by ``get_peft_model``.
    """
    from transformers import AutoModelForCausalLM

    if memory_efficient:
        try:
            if peft_config is not None:
                from .peft import build_meta_peft_model

                return build_meta_peft_model(path, peft_config, **hf_kwargs)
            return build_meta_model(path, **hf_kwargs)
        except PlainLoadNeeded as why:
            logger.warning("memory-efficient loading does not apply (%s); loading the whole model on every "
                           "rank with transformers' from_pretrained", why)
    hf_kwargs.setdefault("use_safetensors", True)  # weights from safetensors only, unless asked otherwise
    model = AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)
    if peft_config is None:
        return model
    from peft import get_peft_model

    from .peft import check_targets

    check_targets(model, peft_config)
    return get_peft_model(model, peft_config)
