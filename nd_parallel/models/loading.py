"""Memory-efficient loading: the model is built without weights, and each rank reads only what it will own.

``from_pretrained`` is the one way nd_parallel loads a causal LM. Its memory-efficient path builds the model on
the meta device (``meta.build_meta_model``, which reads only the safetensors headers: ``checkpoint_files``).
At ``accelerator.prepare`` the plugin splits and shards the meta model exactly as it would a real one (PP
stages, TP, FSDP/HSDP all work on meta tensors), then ``load_local_shards`` gives every parameter storage on
the device (``to_empty``) and fills each rank's local piece from ``safe_open(...).get_slice(key)[box]``, where
``box`` is the piece's place in the full tensor (``compute_local_shape_and_global_offset``, which also knows the
``_StridedShard`` placements of FSDP over TP). Reads go in row blocks of ~16 MiB of the file, each through its
own ``safe_open``, so the memory-mapped pages of one block leave the process before the next is read: a rank's
peak is about its own shards plus one block, not the model.

The values equal those of a plain ``from_pretrained``: the same bytes from the same file, cast to the
parameter's dtype the way transformers casts them. Where that cannot be promised (weights that transformers
*converts* on load, such as MoE experts stacked into one tensor or a quantization_config's tensors (gpt-oss' MXFP4
blocks); fp32-kept modules; non-safetensors files),
``from_pretrained`` falls back to the plain path with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from safetensors import safe_open

from .checkpoint_files import PlainLoadNeeded, Tensors
from .meta import ATTR, LazyCheckpoint, build_meta_model, build_meta_peft_model, lazy_checkpoint
from .peft import check_targets

__all__ = ["LoadReport", "PlainLoadNeeded", "build_meta_model", "from_pretrained", "lazy_checkpoint",
           "load_local_shards", "reads_whole_model"]

logger = logging.getLogger(__name__)

# Reads go in blocks of about this many bytes of the file, each mapped and unmapped on its own (read_into).
READ_BLOCK_BYTES = 16 * 2**20


@dataclass
class LoadReport:
    """What ``load_local_shards`` read on this rank (bytes as stored in the checkpoint)."""

    tensors: int = 0
    bytes_read: int = 0
    bytes_total: int = 0  # the whole checkpoint, for the ratio in the log line


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


def one_dim_each(placements) -> bool:
    """Whether every tensor dim is cut by at most one mesh dim (e.g. a packed TP weight, each rank holding its slice
    of both halves, with FSDP on another dim): the local piece, several boxes, is then what ``distribute_tensor``
    cuts from the full tensor without communicating, whatever the order of the placements."""
    if any(p.is_partial() for p in placements):
        return False
    dims = [p.dim for p in placements if not p.is_replicate()]
    return len(dims) == len(set(dims))


def cut_local(target, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` for the DTensor ``target`` whose placements are not one box (``one_dim_each``):
    cut as ``distribute_tensor`` cuts it with ``src_data_rank=None`` (no collective)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(target.device), target.device_mesh, target.placements,
                             src_data_rank=None).to_local()


def is_one_box(placements, mesh_shape) -> bool:
    try:
        check_one_box(placements, mesh_shape)
    except NotImplementedError:
        return False
    return True


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
    if not _boxed(target):  # several boxes (a packed TP weight): the whole tensor is read, this one only
        with safe_open(tensors.files[key], framework="pt", device="cpu") as f:
            full = f.get_tensor(key)
        target.to_local().copy_(cut_local(target, full))
        return full.numel() * full.element_size()
    local, box = local_box(target)
    if local.numel() == 0:  # an uneven FSDP split can leave a rank nothing of a small tensor
        return 0
    file = tensors.files[key]
    if not box:  # a 0-d tensor has no slices
        with safe_open(file, framework="pt", device="cpu") as f:
            piece = f.get_tensor(key)
            local.copy_(piece)
            return piece.element_size()
    row_bytes = tensors.element_size(key)
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


def _boxed(tensor) -> bool:
    """Whether this rank's piece is one box of the full tensor (read as a slice); else it must be cut from the
    whole tensor, which is exact where ``one_dim_each`` holds (anything else is refused by ``local_box``)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor) or is_one_box(tensor.placements, tensor.device_mesh.shape):
        return True
    return not one_dim_each(tensor.placements)


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
    report = LoadReport(bytes_total=sum(lazy.tensors.nbytes(k) for k in set(lazy.names.values())))
    done: set[int] = set()
    with torch.no_grad():
        for module, buffers in zip(modules, kept):
            for name, param in module.named_parameters(remove_duplicate=False):
                if id(param) in done:  # a tied weight: one parameter under two names
                    continue
                done.add(id(param))
                if name in lazy.initial and not _boxed(param):
                    param.to_local().copy_(cut_local(param, lazy.initial[name]))
                    report.tensors += 1
                    continue
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

    check_targets(model, peft_config)
    return get_peft_model(model, peft_config)
