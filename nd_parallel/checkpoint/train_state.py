"""``TrainState``: what checkpointing and fault handling act on, handed to them by the integration layer.

The Accelerate plugin builds one from its Accelerator (``NDParallelPlugin.train_state``) each time it calls into
``checkpoint/`` or ``fault/``; those packages never reach into the plugin or the Accelerator themselves, so they
can be driven by another integration (or a test) that prepares the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from nd_parallel.config import ParallelismConfig


@dataclass
class TrainState:
    """The prepared objects of a run and where this process stands."""

    config: ParallelismConfig
    """The layout, resolved against the world size."""
    device: torch.device
    models: list[nn.Module] = field(default_factory=list)
    """The prepared models (under PP: the pipeline wrappers)."""
    optimizers: list = field(default_factory=list)
    """The prepared optimizers as the loop holds them (Accelerate's wrappers; ``.optimizer`` is torch's)."""
    schedulers: list = field(default_factory=list)
    dataloaders: list = field(default_factory=list)
    custom_objects: list = field(default_factory=list)
    """Objects registered for checkpointing (``state_dict`` / ``load_state_dict``)."""
    process_index: int = 0
    num_processes: int = 1
    is_main_process: bool = True
    step: int = 0
    """The loop's step counter (Accelerate's ``accelerator.step``)."""
    steps_taken: int = 0
    """Optimizer steps taken, skipped ones included (the count fault reports name)."""
    project: object = None
    """Accelerate's ProjectConfiguration (automatic checkpoint naming, iteration, total_limit); shared, so a save
    that advances ``project.iteration`` advances the Accelerator's."""
    project_dir: str | None = None
    scaler: object = None
    """fp16's loss scaler (``state_dict`` / ``load_state_dict``), or None."""

    @property
    def distributed(self) -> bool:
        return dist.is_initialized() and self.num_processes > 1

    @property
    def dp_size(self) -> int:
        return self.config.dp_replicate_size * self.config.dp_shard_size

    def torch_optimizers(self) -> tuple:
        """The torch optimizers inside the prepared wrappers."""
        return tuple(getattr(o, "optimizer", o) for o in self.optimizers)

    def the_model(self) -> nn.Module:
        """The one prepared model a checkpoint holds."""
        if len(self.models) != 1:
            raise NotImplementedError(
                f"save_state / load_state under nd_parallel handle exactly one prepared model, found "
                f"{len(self.models)}; prepare one model per Accelerator (save others with accelerator.save_model)")
        return self.models[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()
