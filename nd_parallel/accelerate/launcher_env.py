"""The launcher boundary: what ``accelerate launch`` / torchrun set in the environment, read and adjusted before
``Accelerator()`` exists so that nd_parallel, not Accelerate, owns the layout. The launcher's variables are read at
this boundary (here, in the CLI, in the rank program and in the Axolotl plugin); the layout's own
``PARALLELISM_CONFIG_*`` variables only in ``nd_parallel.config.sources``."""

from __future__ import annotations

import os

import torch


def adopt_launcher_env(environ=None) -> None:
    """Launcher boundary, before ``Accelerator()``: let it see every rank, with nd_parallel owning the layout."""
    env = os.environ if environ is None else environ
    # `accelerate launch` sets this for a config file with a parallelism_config section; Accelerator() would
    # then build its own ParallelismConfig and mesh, which it refuses on CPU and which would duplicate ours.
    env.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    # With this on, from_pretrained loads real weights on local rank 0 only and expects accelerate's FSDP
    # wrapping to broadcast them; nd_parallel loads the checkpoint on every rank instead.
    if env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() in ("1", "true"):
        env["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    # accelerate's multi-process launcher never sets it (even with use_cpu: true); without it a CPU-only
    # Accelerator() ignores the other ranks.
    if int(env.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"


def launched_world_size(environ=None) -> int:
    """The number of ranks the launcher (torchrun / accelerate launch) started: WORLD_SIZE, 1 when unset."""
    env = os.environ if environ is None else environ
    return int(env.get("WORLD_SIZE", "1"))
