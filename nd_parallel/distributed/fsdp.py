"""FSDP2 / HSDP / replication with ``fully_shard``: one group per decoder layer, plus the root."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from nd_parallel.models.hf import decoder_layers
from nd_parallel.models.quantized import quantized_params

logger = logging.getLogger(__name__)

# A module with this attribute set True computes in fp32 under a bf16 / fp16 policy: it gets an FSDP2 group of its
# own whose parameters stay fp32 (its inputs cast up, its output back to the policy's dtype), e.g. Axolotl's
# fp32_norms (cli/train/norms.py tags the norm modules).
FP32_TAG = "_nd_parallel_fp32"


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    experts: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    offload_params: bool = False,
) -> int:
    """Shard ``model`` in place over ``dp_mesh`` (1-D: FSDP, 2-D: HSDP). Returns the number of groups.

    ``experts`` (split by expert parallelism) get a group of their own over ``expert_mesh``, the dp ranks left
    after ep, before their layer's group takes the rest of the layer over all of ``dp_mesh``.

    Gradients are *summed*, not averaged, across data-parallel ranks: the loss each rank backpropagates is
    already its share of the global-token mean (see ``loss.py``), so the sum is the true gradient.

    ``offload_params``: FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer step on the
    host, each group copied to the device for its forward and backward. Pinned host memory where there is CUDA.
    """
    # pin_memory needs an accelerator; on a CPU-only run the host is the device and the policy moves nothing.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy()
    kwargs = {"mesh": dp_mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(), "offload_policy": offload}
    quantized = set(quantized_params(model))
    if quantized:  # packed 4-bit / 8-bit frozen weights stay whole and replicated (models/quantized.py)
        kwargs["ignored_params"] = quantized
    layers = decoder_layers(model)
    kept = [m for m in model.modules() if getattr(m, FP32_TAG, False)]
    if kept and kwargs["mp_policy"].param_dtype not in (None, torch.float32):  # fp32 norms: their own fp32 groups
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                    output_dtype=kwargs["mp_policy"].param_dtype)
        for module in kept:  # before their layer's group, which then leaves their parameters to them
            fully_shard(module, reshard_after_forward=reshard_after_forward, **dict(kwargs, mp_policy=fp32))
    for module in experts:
        fully_shard(module, reshard_after_forward=reshard_after_forward, **dict(kwargs, mesh=expert_mesh))
    for group in sharing_groups(layers):  # layers that share a parameter (peft's layer_replication) share a group
        fully_shard(group if len(group) > 1 else group[0], reshard_after_forward=reshard_after_forward, **kwargs)
    # The root keeps embeddings, final norm and lm_head (tied or not) in one group; they are needed first in
    # backward, so they are not resharded after forward.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in groups:
        module.set_gradient_divide_factor(1.0)
        # A custom factor otherwise selects PREMUL_SUM, which gloo lacks; with factor 1 a plain SUM is exact.
        module.set_force_sum_reduction_for_comms(True)
    kind = "HSDP" if dp_mesh.ndim == 2 else "FSDP"
    logger.info("applied %s over %s ranks to %d layers + root%s", kind, "x".join(map(str, dp_mesh.shape)), len(layers),
                ", parameters offloaded to host memory" if offload_params else "")
    return len(groups)


def sharing_groups(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """The layers in groups of those that hold a common parameter (transitively), in layer order. FSDP2 manages a
    parameter in one group only, so layers sharing one (peft's layer_replication: the copies share their base
    weights) are sharded together, ``fully_shard([layer_a, layer_b])``, as FSDP2 asks for shared parameters."""
    owner: dict[int, int] = {}  # id(parameter) -> the first layer holding it
    root = list(range(len(layers)))

    def find(i: int) -> int:
        while root[i] != i:
            i = root[i]
        return i

    for i, layer in enumerate(layers):
        for param in layer.parameters():
            j = owner.setdefault(id(param), i)
            if j != i:
                root[find(i)] = find(j)
    groups: dict[int, list[nn.Module]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault(find(i), []).append(layer)
    return list(groups.values())
