"""One named DeviceMesh over every parallel dimension, built once.

Dimension order (outermost first) is ``(pp, dp_replicate, dp_shard, cp, tp)``: tp is innermost so a TP
group is made of neighbouring ranks (same node on GPUs), pp is outermost because stages exchange only
activations. Every dimension exists even at size 1, so code asks for ``mesh["tp"]`` without checking
whether TP is on; the flattened views below are what each parallelism communicates over.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nd_parallel.config import ParallelismConfig

logger = logging.getLogger(__name__)

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Expert parallelism borrows its ranks from dp_shard: dp_shard = dp_shard_mod_ep x ep (see ParallelMesh.experts).
EP_DIM_NAMES = ("dp_shard_mod_ep", "ep")

# Flattened views: name -> the mesh dims it spans. Built eagerly in build_mesh because flattening
# creates process groups, which is a collective every rank must enter in the same order.
FLAT_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),  # ranks that see different samples (dataloader sharding)
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP shards over the cp ranks too (they hold equal weights)
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # ranks whose token counts add up to the global loss
}


def backend_for(device_type: str) -> str:
    """The collective backend used for a device type (cpu -> gloo, cuda -> nccl)."""
    return {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}.get(device_type, "gloo")


@dataclass
class ParallelMesh:
    """The world mesh plus the views the parallelisms ask for by name."""

    config: ParallelismConfig
    world: DeviceMesh
    flat: dict[str, DeviceMesh]
    experts: DeviceMesh | None = None
    """With ep_size > 1: the world mesh with dp_shard split into (dp_shard_mod_ep, ep), ep innermost so that an
    ep group is made of neighbouring ranks (the all-to-all stays within a node where it can)."""

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        # Flattened views are kept as _flatten returned them: slicing them back out of the root mesh is
        # deprecated in torch.
        if isinstance(name, str) and name in self.flat:
            return self.flat[name]
        if self.experts is not None and name in EP_DIM_NAMES:
            return self.experts[name]
        return self.world[name]

    @property
    def device_type(self) -> str:
        return self.world.device_type

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()

    @cached_property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """Mesh handed to ``fully_shard``: 1-D (dp_shard*cp) for FSDP, 2-D (dp_replicate, dp_shard*cp) for HSDP.

        Plain replication (dp_replicate>1, dp_shard=1) is HSDP with a shard group of one rank; that
        keeps one code path and, unlike DDP, composes with TP's DTensor parameters.
        """
        c = self.config
        if c.dp_replicate_size * c.dp_shard_size * c.cp_size == 1:
            return None
        shard = "dp_shard" if c.cp_size == 1 else "dp_shard_cp"
        if c.dp_replicate_size > 1:
            return self.world[("dp_replicate", shard)]
        return self[shard]

    @cached_property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """Mesh the experts are FSDP-sharded over: the dp ranks left after ep (1-D, or 2-D with dp_replicate).

        As torchtitan: the experts are split over ep and sharded over the rest, the other weights over all of dp.
        """
        if self.experts is None:
            return None
        # Like fsdp_mesh: the cp ranks hold equal weights, so the experts are sharded over them too.
        shard = "dp_shard_mod_ep" if self.config.cp_size == 1 else "dp_shard_mod_ep_cp"
        if self.config.dp_replicate_size > 1:
            return self.experts[("dp_replicate", shard)]
        return self.flat[shard] if shard in self.flat else self.experts[shard]

    def describe(self) -> str:
        coords = ", ".join(f"{n}={self.world[n].get_local_rank()}/{self.world[n].size()}" for n in DIM_NAMES)
        return f"rank {dist.get_rank()}: {coords}"


def build_mesh(config: ParallelismConfig, device_type: str) -> ParallelMesh:
    """Build the named mesh for a config already resolved against the world size."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; create the Accelerator (or call "
            "torch.distributed.init_process_group) before building the mesh"
        )
    world_size = dist.get_world_size()
    if config.world_size != world_size:
        # resolve() raises the detailed message; reaching here means the caller skipped it.
        config = config.resolve(world_size)
    shape = tuple(getattr(config, f"{n}_size") for n in DIM_NAMES)
    key = (device_type, shape, config.ep_size)
    default = dist.distributed_c10d._get_default_group()
    cached = _BUILT.get(key)
    if cached is not None and cached[0]() is default:
        return ParallelMesh(config, *cached[1:])
    world = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
    flat = {name: world[dims]._flatten(name) for name, dims in FLAT_VIEWS.items()}
    experts = None
    if config.ep_size > 1:  # creates the ep and dp_shard_mod_ep groups: a collective, so built here with the rest
        ep = config.ep_size
        experts = world._unflatten(DIM_NAMES.index("dp_shard"), (config.dp_shard_size // ep, ep), EP_DIM_NAMES)
        if config.cp_size > 1:
            flat["dp_shard_mod_ep_cp"] = experts[("dp_shard_mod_ep", "cp")]._flatten("dp_shard_mod_ep_cp")
    logger.info("built %s mesh %s over %d ranks%s", device_type, dict(zip(DIM_NAMES, shape)), world_size,
                f", experts over ep={config.ep_size}" if experts is not None else "")
    if any(entry[0]() is not default for entry in _BUILT.values()):  # the world was torn down and made again
        _BUILT.clear()
    _BUILT[key] = (weakref.ref(default), world, flat, experts)
    return ParallelMesh(config, world, flat, experts)


# Meshes already built in this process, by (device type, shape, ep): a second Accelerator (a notebook, a sweep, a
# test worker that trains many layouts) gets the same process groups back instead of new ones. torch's
# init_device_mesh creates fresh groups on every call and nothing frees them (each gloo group keeps its threads
# and sockets: thousands of threads after a few hundred builds). Every rank builds the same sequence of meshes, so
# every rank hits or misses the cache together. An entry knows the default group it was built under by a weak
# reference (holding it would keep a destroyed world's groups alive until exit): after destroy_process_group and a
# new init_process_group, nothing stale is returned.
_BUILT: dict[tuple, tuple] = {}


def single_process_group(device_type: str) -> None:
    """A one-rank process group for a single process that needs a mesh (bf16 runs through ``fully_shard``).

    An in-memory store: nothing listens on a port, nothing else can join.
    """
    if dist.is_initialized():
        return
    dist.init_process_group(backend_for(device_type), store=dist.HashStore(), rank=0, world_size=1)
