"""``ParallelismConfig.build_device_mesh``: our mesh handed out as a DeviceMesh, the way Accelerate's config does.

Accelerate's ``build_device_mesh(device_type)`` initialises torch.distributed from the launcher's variables when
needed (``init_device_mesh`` does), builds a mesh of the enabled dimensions and flattens ``dp``, ``dp_shard_cp``
and ``dp_cp`` on it. Ours builds nd_parallel's one mesh (``mesh.build_mesh``: every dimension by name, size-1 ones
included, the same three flattened views) and keeps the ``ParallelMesh`` on the config, so that the plugin attached
later uses this mesh instead of building a second one.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from nd_parallel.config import ConfigError

from .mesh import ParallelMesh, backend_for, build_mesh

logger = logging.getLogger(__name__)


def accelerate_world_size(config, world: int) -> None:
    """Accelerate's rule, kept: a config whose sizes are all 1 launched on several ranks is plain data parallelism
    over all of them (its ``_validate_accelerator`` sets dp_replicate_size to the number of processes)."""
    if config.dp_shard_size != -1 and config.world_size == 1 and world > 1:
        logger.info("every size is 1 on %d ranks: data parallelism over all of them (dp_replicate_size=%d), as "
                    "Accelerate's ParallelismConfig does", world, world)
        config.dp_replicate_size = world


def build_device_mesh(config, device_type: str):
    """The world DeviceMesh of ``config`` (None on one process, as Accelerate's for a layout of size 1)."""
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        dist.init_process_group(backend_for(device_type))  # the launcher's MASTER_ADDR / RANK / WORLD_SIZE
    world = dist.get_world_size()
    accelerate_world_size(config, world)
    if world == 1:
        return None
    resolved = config.resolve(world)
    existing = parallel_mesh_of(config)
    if existing is not None and existing.config == resolved and existing.device_type == device_type:
        return existing.world
    from .tensor_parallel import check_styles

    check_styles(resolved.tp_plan or {})  # before the mesh, the first collective
    mesh = build_mesh(resolved, device_type)
    config._nd_parallel_mesh = mesh
    return mesh.world


def parallel_mesh_of(config) -> ParallelMesh | None:
    """The ParallelMesh ``build_device_mesh`` built for this config object, if any."""
    mesh = getattr(config, "_nd_parallel_mesh", None)
    if mesh is not None and not isinstance(mesh, ParallelMesh):
        raise ConfigError(f"config._nd_parallel_mesh is {type(mesh).__name__}, not a ParallelMesh")
    return mesh
