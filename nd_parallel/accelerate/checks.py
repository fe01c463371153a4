"""What ``attach`` and ``prepare`` refuse about the Accelerator and the objects handed to it, before any collective."""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType

from nd_parallel.config import ParallelismConfig
from nd_parallel.distributed.precision import check_mixed_precision
from nd_parallel.distributed.tensor_parallel import check_styles

_SUPPORTED_TYPES = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP}


def check_accelerator(accelerator, launched: int) -> None:
    """How the Accelerator was launched and its precision, before the layout is resolved against it."""
    if accelerator.distributed_type not in _SUPPORTED_TYPES:
        raise NotImplementedError(
            f"Accelerator distributed_type={accelerator.distributed_type} is not supported by nd_parallel; "
            "launch with plain multi-process (accelerate launch --multi_gpu / --cpu, or torchrun)")
    check_mixed_precision(accelerator.mixed_precision)
    check_saw_all_ranks(accelerator, launched)


def check_layout(accelerator, config: ParallelismConfig) -> None:
    """A resolved layout against the Accelerator: what DeepSpeed's engine allows, the TP overrides' styles."""
    deepspeed_pp = config.pp_size > 1 and config.pp_backend == "deepspeed"
    if deepspeed_pp and accelerator.mixed_precision in ("bf16", "fp16"):
        raise NotImplementedError(
            f"mixed_precision={accelerator.mixed_precision!r} with pp_backend='deepspeed': DeepSpeed's pipeline engine "
            "keeps its own precision state (and loss scaler) and would not follow nd_parallel's fp32-master recipe; "
            "use pp_backend='torch'")
    check_styles(config.tp_plan or {})  # a typo in an override is an error even while tp_size=1
    if deepspeed_pp:
        from nd_parallel.distributed.pipeline.deepspeed_backend import require_deepspeed

        require_deepspeed()  # a missing package is reported before the first collective


def check_saw_all_ranks(accelerator, launched: int) -> None:
    """A CPU-only Accelerator() ignores torchrun's ranks unless told to use the CPU: say so instead of hanging.
    ``launched``: the WORLD_SIZE the launcher set (read at the launcher boundary, launcher_env.py)."""
    if accelerator.num_processes == 1 and launched > 1:
        raise RuntimeError(
            f"the launcher started WORLD_SIZE={launched} ranks but the Accelerator sees 1 process: on a machine "
            "without GPUs create it with Accelerator(cpu=True), launch with `accelerate launch --cpu`, or set "
            "ACCELERATE_USE_CPU=true")


def check_master_weights(model: torch.nn.Module, mixed_precision) -> None:
    """fp16 keeps fp32 master weights: a trainable fp16 parameter would take updates below 2**-11 of its value as 0,
    and the loss scaler refuses to unscale fp16 gradients. Refused before any collective."""
    if mixed_precision != "fp16":
        return
    low = [name for name, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    if low:
        raise ValueError(
            f"mixed_precision='fp16' with {len(low)} trainable fp16 parameter(s) (e.g. {low[0]}): fp16 mixed "
            "precision keeps fp32 master weights and computes in fp16; load the model in fp32 (dtype=torch.float32, "
            "the default) and let mixed_precision='fp16' cast it for compute")


def check_fresh_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if optimizer.state:
        raise ValueError(
            "the optimizer already has state (it has stepped); build it on the unsharded model and pass it to "
            "prepare() before the first step, so it can be re-pointed to the sharded parameters")

