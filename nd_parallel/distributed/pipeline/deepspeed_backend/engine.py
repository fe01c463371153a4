"""The glue to DeepSpeed's pipeline engine: our split as its partition, its optimizer step handed to ours.

Everything here touches DeepSpeed's own objects (``PipelineModule``, the topology, the engine and its
instruction map, the accelerator), so it is kept apart from the layers, which run without DeepSpeed, and
from the model the training loop sees. DeepSpeed is imported inside the functions: it is optional.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from nd_parallel.distributed.mesh import backend_for


@functools.cache
def presplit_module_class():
    from deepspeed.pipe import PipelineModule

    class PresplitPipelineModule(PipelineModule):
        """A PipelineModule whose stage boundaries are given (our split) instead of computed by DeepSpeed.

        DeepSpeed's partition methods ("uniform", "parameters", "type:regex") balance by counts or weights;
        none reproduces an explicit ``pp_balance`` or the uniform split's rule of giving extra layers to the
        middle stages, so the one method that applies the boundaries is replaced.
        """

        def __init__(self, layers, boundaries: list[int], **kwargs):
            self.given_boundaries = list(boundaries)  # read by _partition_layers during super().__init__
            super().__init__(layers, **kwargs)

        def _partition_layers(self, method=None):
            self.parts = list(self.given_boundaries)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return PresplitPipelineModule


class _NeverSteps(torch.optim.Optimizer):
    """The optimizer handed to DeepSpeed, which requires one to run backward; the user's optimizer steps."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})

    def step(self, closure=None):
        raise RuntimeError("the DeepSpeed pipeline backend's placeholder optimizer must never step")


def _skip_optimizer_step(engine, **kwargs):
    """Replaces DeepSpeed's OptimizerStep instruction, the last of its TrainSchedule.

    The schedule ends with ReduceTiedGrads, ReduceGrads, OptimizerStep. We keep the first two and drop the
    step, because the user's optimizer (re-pointed by the plugin) steps in the Accelerate loop after clipping.
    Handing DeepSpeed a no-op optimizer and keeping its step would not do: DeepSpeed's step also zeroes the
    gradients (``_take_model_step``) before the loop could clip and apply them. Only the step count is kept.
    """
    engine.global_steps += 1


def _check_topology(topo, mesh) -> None:
    """DeepSpeed's (pipe, data) rank grid must be our mesh's (pp, dp_replicate) grid, rank for rank."""
    grid = mesh.world.mesh.reshape(mesh.size("pp"), mesh.size("dp_replicate"))
    for pp in range(grid.shape[0]):
        for dp in range(grid.shape[1]):
            coord = topo.get_coord(int(grid[pp, dp]))
            if (coord.pipe, coord.data) != (pp, dp):
                raise RuntimeError(f"DeepSpeed places rank {int(grid[pp, dp])} at (pipe={coord.pipe}, data="
                                   f"{coord.data}), the mesh at (pp={pp}, dp={dp}); the rank layouts differ")


def make_topology(mesh, pp: int, dp: int):
    """DeepSpeed's pipe x data topology, checked to place every rank where the mesh does."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    topo = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    _check_topology(topo, mesh)
    return topo


def _ds_config(microbatches: int, dp: int) -> dict:
    return {
        # Only DeepSpeed's throughput log reads the micro-batch size; ours may be any size, so 1 stands in.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": microbatches,
        "train_batch_size": microbatches * dp,
        "gradient_allreduce_op": "sum",  # see model.MicroBatchLoss
        "zero_optimization": {"stage": 0},
        "pipeline": {"activation_checkpoint_interval": 0},  # layers.DecoderLayer relies on it
    }


def check_device(device: torch.device) -> None:
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != device.type:
        raise RuntimeError(
            f"DeepSpeed chose its '{name}' accelerator but the model runs on {device.type}; set "
            f"DS_ACCELERATOR={device.type} in the environment the ranks are launched with")


def check_same_parameters(pipe: nn.Module, skeleton: nn.Module) -> None:
    ds_ids, hf_ids = {id(p) for p in pipe.parameters()}, {id(p) for p in skeleton.parameters()}
    if ds_ids != hf_ids:
        extra = [n for n, p in pipe.named_parameters() if id(p) not in hf_ids]
        missing = [n for n, p in skeleton.named_parameters() if id(p) not in ds_ids]
        raise RuntimeError(f"the DeepSpeed stage and its HF view hold different parameters: only DeepSpeed "
                           f"{extra[:5]}, only HF {missing[:5]}")


def _skip_shm_kernel_build(device: torch.device) -> None:
    """On CPU, DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce kernel (minutes on a small
    machine) that only its inference all-reduce path uses; pipeline training never calls it. Marking the op
    unavailable makes DeepSpeed skip the build and use torch.distributed, exactly as when it cannot compile."""
    if device.type != "cpu":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(deepspeed, device: torch.device) -> None:
    """DeepSpeed's comm layer on top of the process group that already exists."""
    _skip_shm_kernel_build(device)
    deepspeed.init_distributed(dist_backend=backend_for(device.type), dist_init_required=False)


def make_engine(deepspeed, pipe: nn.Module, microbatches: int, dp: int):
    """DeepSpeed's pipeline engine over ``pipe``, with its optimizer step left to the user's optimizer."""
    from deepspeed.runtime.pipe.schedule import OptimizerStep

    engine, *_ = deepspeed.initialize(model=pipe, optimizer=_NeverSteps(pipe.parameters()),
                                      config=_ds_config(microbatches, dp), dist_init_required=False)
    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, OptimizerStep: _skip_optimizer_step}
    return engine
