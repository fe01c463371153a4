"""QLoRA under tensor parallelism: a 4-bit (NF4/FP4) base Linear split column- or row-wise, its weight frozen.

torch's ``ColwiseParallel``/``RowwiseParallel`` turn a Linear's weight into a DTensor, which a bitsandbytes
``Params4bit`` cannot be (packed bytes, two values per byte, with per-block statistics in ``quant_state`` beside
the tensor). So a quantized base layer gets its own style here, with the same meaning as the float one:

- **sharded** when the quantization blocks line up with the split (colwise: ``out/tp * in`` a multiple of the
  block size; rowwise: ``in/tp`` a multiple of it, as in every real model): this rank keeps exactly the packed bytes
  and block statistics of its rows (colwise) or of its column range of every row (rowwise), 1/tp of the base.
  The statistics are kept as the fp32 ``absmax`` double quantization decodes to (bitsandbytes computes that same
  fp32 vector before every dequantization), so the local weight dequantizes to the same values as the rows or
  columns of the whole one; the cost is 4 bytes per block instead of ~1 (0.0625 instead of ~0.016 byte/param).
- **replicated** otherwise (a tiny model's 64-wide rowwise layer split in two halves a 64-value block): every TP
  rank keeps the whole packed weight and dequantizes it, then uses its slice. Exact, but no memory saving.

The collectives are torch's own, through DTensor (no hand-written autograd): colwise takes a replicated input whose
gradient is a partial sum over TP (Megatron's "f": identity forward, all-reduce backward); rowwise takes this rank's
input features and sums the partial outputs over TP (Megatron's "g": all-reduce forward, identity backward). A LoRA
adapter on the same layer is split by ``tensor_parallel_lora``'s styles, so base and adapter outputs add up locally.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

logger = logging.getLogger(__name__)

# HF TP style of a quantized base layer -> the weight dim it splits (0: output features, 1: input features).
QUANTIZED_STYLES = {"colwise": 0, "rowwise": 1}


def is_quantized_linear(module: nn.Module) -> bool:
    """A Linear whose weight is a packed 4-bit bitsandbytes parameter (it carries a ``quant_state``)."""
    weight = getattr(module, "weight", None)
    return weight is not None and getattr(weight, "quant_state", None) is not None


def check_quantized_tp(name: str, module: nn.Module, style: str, tp_size: int) -> None:
    """Refuse, before any collective, a quantized base layer TP cannot split with its float meaning."""
    if style not in QUANTIZED_STYLES:
        raise NotImplementedError(
            f"'{name}' is a 4-bit quantized Linear sharded as '{style}': only {sorted(QUANTIZED_STYLES)} split a "
            f"quantized base. Keep it whole with ParallelismConfig(tp_plan={{'{name}': None}}) or load it "
            f"unquantized (drop it from BitsAndBytesConfig via llm_int8_skip_modules)")
    size = module.weight.quant_state.shape[QUANTIZED_STYLES[style]]
    if size % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide dim {QUANTIZED_STYLES[style]} (size {size}) of the "
                         f"quantized '{name}'; use tp_size in {[d for d in range(1, size + 1) if size % d == 0]}")
    if style == "rowwise" and module.bias is not None:
        raise NotImplementedError(
            f"'{name}' is a quantized row-wise Linear with a bias: its bias would be added on every TP rank before "
            f"the sum. Keep it whole with ParallelismConfig(tp_plan={{'{name}': None}})")


def _absmax_fp32(qs) -> torch.Tensor:
    """The per-block scales as fp32, decoded from double quantization exactly as ``dequantize_4bit`` does."""
    if not qs.nested:
        return qs.absmax.float()
    import bitsandbytes.functional as bnbf

    absmax = bnbf.dequantize_blockwise(qs.absmax, qs.state2)
    absmax += qs.offset
    return absmax.float()


def _aligned(qs, dim: int, tp: int) -> bool:
    out, inn = qs.shape
    return (out // tp * inn) % qs.blocksize == 0 if dim == 0 else inn % qs.blocksize == 0 and (
        inn // tp) % qs.blocksize == 0


def _local_slice(weight, dim: int, rank: int, tp: int):
    """(packed bytes, fp32 absmax, shape) of this rank's part of a packed 4-bit weight; blocks must be aligned."""
    qs = weight.quant_state
    out, inn = qs.shape
    bs, packed, absmax = qs.blocksize, weight.data.reshape(-1), _absmax_fp32(qs)
    if dim == 0:  # rows [rank*n, (rank+1)*n): one contiguous run of the row-major flattened values
        n = out // tp * inn
        start = rank * n
        return packed[start // 2:(start + n) // 2], absmax[start // bs:(start + n) // bs], (out // tp, inn)
    cols = inn // tp  # columns [rank*cols, (rank+1)*cols) of every row: whole blocks of each row
    lo = rank * cols
    local = packed.view(out, inn // 2)[:, lo // 2:(lo + cols) // 2]
    scales = absmax.view(out, inn // bs)[:, lo // bs:(lo + cols) // bs]
    return local.reshape(-1), scales.reshape(-1), (out, cols)


def _shard_weight(module: nn.Module, dim: int, rank: int, tp: int) -> None:
    import bitsandbytes.functional as bnbf
    from bitsandbytes.nn import Params4bit

    weight = module.weight
    qs = weight.quant_state
    packed, absmax, shape = _local_slice(weight, dim, rank, tp)
    local_qs = bnbf.QuantState(absmax=absmax.contiguous().clone(), shape=torch.Size(shape), code=qs.code,
                               blocksize=qs.blocksize, quant_type=qs.quant_type, dtype=qs.dtype)
    module.weight = Params4bit(packed.contiguous().clone().view(-1, 1), requires_grad=False, quant_state=local_qs,
                               blocksize=qs.blocksize, compress_statistics=False, quant_type=qs.quant_type,
                               quant_storage=weight.quant_storage, module=module, bnb_quantized=True)
    module._nd_parallel_tp_part = (dim, rank, tp)  # its state dict is this rank's part (models/quantized.py refuses it)


def _local_weight(module: nn.Module, dim: int, rank: int, tp: int, sharded: bool) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    weight = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state)  # [out, in] or this rank's part
    if sharded:
        return weight
    n = weight.shape[dim] // tp
    return weight.narrow(dim, rank * n, n)


def _forward(module: nn.Module, mesh: DeviceMesh, dim: int, sharded: bool, x: torch.Tensor) -> torch.Tensor:
    tp, rank = mesh.size(), mesh.get_local_rank()
    dtype = x.dtype
    compute = getattr(module, "compute_dtype", None) or dtype
    if dim == 0:  # replicated input: its gradient from this rank's output columns is partial over TP
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    weight = _local_weight(module, dim, rank, tp, sharded).to(compute)
    bias = module.bias
    if bias is not None and dim == 0:
        bias = bias.narrow(0, rank * weight.shape[0], weight.shape[0]).to(compute)
    y = F.linear(x.to(compute), weight, bias)
    if dim == 1:  # this rank's input features: the output is a partial sum over TP
        y = DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    return y.to(dtype)


def apply_quantized_tp(module: nn.Module, style: str, mesh: DeviceMesh) -> str:
    """Split a 4-bit base Linear in place over ``mesh`` as ``style``; returns 'sharded' or 'replicated'."""
    dim, tp = QUANTIZED_STYLES[style], mesh.size()
    sharded = _aligned(module.weight.quant_state, dim, tp)
    if sharded:
        _shard_weight(module, dim, mesh.get_local_rank(), tp)
    module.forward = functools.partial(_forward, module, mesh, dim, sharded)
    return "sharded" if sharded else "replicated"
