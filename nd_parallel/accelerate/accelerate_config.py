"""What the Accelerator shows of the layout: ``accelerator.parallelism_config`` and ``accelerator.torch_device_mesh``.

Accelerate keeps both on its shared ``AcceleratorState``; scripts written for its ND parallelism read them (the
``dp_cp`` group to average a loss over, ``tp_enabled`` to load with ``tp_plan``). Under nd_parallel they hold our
``ParallelismConfig`` (which has Accelerate's API, ``config/accelerate_api.py``) and our mesh: every dimension by
name (``pp, dp_replicate, dp_shard, cp, tp``) and the flattened ``dp``, ``dp_shard_cp``, ``dp_cp``.
"""

from __future__ import annotations

from nd_parallel.config import ConfigError, ParallelismConfig
from nd_parallel.distributed.device_mesh import parallel_mesh_of
from nd_parallel.distributed.mesh import ParallelMesh

# The sizes Accelerate's config and ours both have; ours adds pp_size.
SHARED_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")


def refuse_different_sizes(ours, theirs, ours_name: str, theirs_name: str) -> None:
    """Two configs given for one run must name the same layout; refused before any collective otherwise."""
    names = SHARED_SIZES + (("pp_size",) if hasattr(theirs, "pp_size") else ())
    if ours.dp_shard_size == -1 or getattr(theirs, "dp_shard_size", None) == -1:
        names = tuple(n for n in names if n != "dp_shard_size")  # -1 is resolved against the world size
    differ = [n for n in names if getattr(ours, n) != getattr(theirs, n)]
    if differ:
        a = ", ".join(f"{n}={getattr(ours, n)}" for n in differ)
        b = ", ".join(f"{n}={getattr(theirs, n)}" for n in differ)
        raise ConfigError(f"{theirs_name} says {b} but {ours_name} says {a}: two layouts for one run; give the "
                          "layout once (nd_parallel's ParallelismConfig carries every Accelerate size)")


def refuse_two_layouts(accelerator, config: ParallelismConfig) -> None:
    """The Accelerator already has a parallelism_config (Accelerate's own, or ours on another object): it must
    name the layout the plugin is given."""
    theirs = getattr(accelerator, "parallelism_config", None)
    if theirs is None or theirs is config:
        return
    if left_by_earlier_plugin(theirs, accelerator):  # this attach replaces it
        return
    refuse_different_sizes(config, theirs, "nd_parallel's ParallelismConfig",
                           f"Accelerator(parallelism_config={type(theirs).__module__}.{type(theirs).__name__})")


def left_by_earlier_plugin(config, accelerator) -> bool:
    """``config`` was put on Accelerate's process-wide ``AcceleratorState`` by the plugin of an earlier Accelerator
    of this process (``show``; a script that trains several layouts in turn), not given for ``accelerator``."""
    return getattr(config, "_nd_parallel_shown", False) and getattr(accelerator, "nd_parallel", None) is None


def mesh_built_for(given: ParallelismConfig, resolved: ParallelismConfig) -> ParallelMesh | None:
    """The mesh ``given.build_device_mesh`` already built (Accelerator() asks for it first), when it is this layout."""
    mesh = parallel_mesh_of(given)
    return mesh if mesh is not None and mesh.config == resolved else None


def show(accelerator, config: ParallelismConfig, mesh: ParallelMesh | None, expose: bool) -> None:
    """Set ``accelerator.parallelism_config`` / ``torch_device_mesh`` (the mesh once built); see the docstring."""
    state = getattr(accelerator, "state", None)  # AcceleratorState, shared by every Accelerator of the process
    if not expose or state is None:
        return
    state.parallelism_config = config
    config._nd_parallel_shown = True  # refuse_two_layouts: ours, not the user's
    if mesh is not None:
        config.device_mesh = mesh.world
        config._nd_parallel_mesh = mesh
        state.device_mesh = mesh.world
