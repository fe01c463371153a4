"""LoftQ initialization of a LoRA adapter (peft's ``init_lora_weights="loftq"``, Axolotl's
``peft: {loftq_config: {loftq_bits: 4}}``) on any device.

LoftQ starts LoRA from the quantization error: each adapted weight ``W`` is replaced by its NF4 (or int8) round
trip ``Q = deq(q(W))`` and the adapter by the rank-``r`` SVD of ``W - Q`` (``B = U sqrt(S)``, ``A = sqrt(S) Vh``), so
``Q + B A`` starts close to ``W`` on a base that a 4-bit model would hold. peft computes it in ``loftq_init``,
which moves every weight to ``"cuda"`` (or XPU) by name; ``cpu_loftq`` swaps in the same steps on the weight's own
device for the duration of ``get_peft_model`` (bitsandbytes quantizes on CPU too), reusing peft's own SVD split.

Every rank runs the same deterministic steps on the same full weights before the layout is applied, so the adapter
and the replaced base are identical on every rank and in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@torch.no_grad()
def loftq_on_device(weight: torch.Tensor, num_bits: int, reduced_rank: int, num_iter: int = 1):
    """peft's ``loftq_init`` (the same quantizer settings, iterations and SVD) on ``weight.device``."""
    import bitsandbytes as bnb
    from peft.utils.loftq_utils import _low_rank_decomposition

    if num_bits not in (4, 8):
        raise ValueError(f"LoftQ quantizes to 4 (NF4) or 8 (int8) bits, got loftq_bits={num_bits}")
    device, dtype = weight.device, weight.dtype
    weight = weight.to(torch.float32)
    res = weight.clone()
    for i in range(num_iter):
        if num_bits == 4:
            q = bnb.nn.Params4bit(res.cpu(), requires_grad=False, compress_statistics=False, quant_type="nf4")
            q = q.to(device)
            dequantized = bnb.functional.dequantize_4bit(q.data, q.quant_state).to(torch.float32)
        else:
            q = bnb.nn.Int8Params(res.cpu(), requires_grad=False).to(device)
            dequantized = bnb.functional.int8_vectorwise_dequant(q.data, q.SCB).to(torch.float32)
        res = weight - dequantized
        split = _low_rank_decomposition(res, reduced_rank=reduced_rank)
        left, right = split["L"], split["R"]
        if i + 1 < num_iter:
            res = weight - left @ right
    return dequantized.to(device=device, dtype=dtype), right, left


@contextlib.contextmanager
def cpu_loftq() -> Iterator[None]:
    """Inside, peft's LoRA layers run ``loftq_on_device`` for ``init_lora_weights="loftq"`` where there is no CUDA
    (peft's own ``loftq_init`` runs unchanged where there is)."""
    from peft.tuners.lora import layer

    if torch.cuda.is_available():
        yield
        return
    original = layer.loftq_init
    layer.loftq_init = loftq_on_device
    try:
        yield
    finally:
        layer.loftq_init = original
