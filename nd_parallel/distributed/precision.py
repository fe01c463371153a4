"""Mixed precision: fp32 master weights and optimizer state, bf16 or fp16 compute, fp32 gradient reduction.

Built on FSDP2's ``MixedPrecisionPolicy``: parameters stay fp32 (the sharded parameter the optimizer sees), the
all-gather casts them to bf16 for forward and backward, and gradients are cast back to fp32 *before* they are
reduced across data-parallel ranks. So that every layout runs the same recipe, the policy is applied also where
no dimension shards (TP only, PP only, one process): ``fully_shard`` over a one-rank mesh then does nothing but
the casts. The loss is computed in fp32 (transformers' loss upcasts the logits) and the context-parallel ring
keeps its running max / log-sum-exp in fp32.

Accelerate's own bf16 path (``autocast`` around forward) is not used: it computes some ops in bf16 and others in
fp32 on a per-op list, which is not what FSDP2 does with the same setting; one recipe for every layout is what
makes "bf16 under layout X equals bf16 in one process" a testable statement.

fp16 is the same recipe with ``param_dtype=float16`` plus dynamic loss scaling (``grad_scaler.MeshGradScaler``,
installed by the Accelerate integration as ``accelerator.scaler``): fp16's 5 exponent bits underflow small
gradients unless the loss is scaled up first, and overflow when it is scaled too far, which skips the step.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

SUPPORTED = ("no", "bf16", "fp16")
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_mixed_precision(value) -> None:
    """Refuse, before any collective, what cannot be honoured: fp8, typos."""
    value = "no" if value is None else str(value)
    if value in SUPPORTED:
        return
    if value == "fp8":
        raise NotImplementedError(
            "mixed_precision='fp8' is not supported by nd_parallel (it needs TransformerEngine/torchao kernels on "
            "Hopper GPUs); use mixed_precision='bf16'")
    raise ValueError(f"mixed_precision={value!r} is not a precision; use 'no' (fp32), 'bf16' or 'fp16'")


def policy_for(mixed_precision) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy for Accelerate's ``mixed_precision`` value; None for fp32 training."""
    check_mixed_precision(mixed_precision)
    if mixed_precision in (None, "no"):
        return None
    # reduce_dtype=fp32: gradients are summed across ranks in fp32, whatever the compute dtype.
    # output_dtype=None: activations passed between pipeline stages stay bf16/fp16, as between layers in one process.
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[mixed_precision], reduce_dtype=torch.float32)
