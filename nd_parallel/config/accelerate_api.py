"""Accelerate's ``ParallelismConfig`` API on ours, so a script written for Accelerate's ND parallelism changes one import.

Every public attribute of ``accelerate.parallelism_config.ParallelismConfig`` (1.13 - 1.15) is here with the same
value for the same sizes (``tests/unit/test_accelerate_api.py`` compares them and fails on a new one): the
``*_enabled`` flags, the ``*_dim_names`` lists, ``total_size``, ``non_data_parallel_size``, ``data_parallel_size``,
``build_device_mesh`` / ``get_device_mesh`` / ``device_mesh``, and the fields ``sp_size``, ``sp_backend`` and the
three handlers. Where ours has more (pipeline parallelism), the meaning is kept and pp joins the dimensions that
receive the same batch (``non_dp_dim_names``, ``non_data_parallel_size``); with ``pp_size=1`` every value equals
Accelerate's.

The Accelerator calls two of these itself: ``get_device_mesh(device_type)`` and then ``_validate_accelerator(self)``,
both from ``Accelerator.__init__``. The mesh is built by ``nd_parallel/distributed/mesh.py`` and the plugin attached
by ``nd_parallel/accelerate/``: layers above this one, reached through the two functions ``connect`` is given by
``nd_parallel/__init__.py`` (the core never imports the integrations; the public package wires them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .checks import ConfigError
from .layout import Layout

# What ``connect`` installs: build_mesh(config, device_type) -> DeviceMesh, attach(config, accelerator) -> None.
_WIRING: dict[str, Callable[..., Any] | None] = {"build_mesh": None, "attach": None}


def connect(*, build_mesh: Callable[..., Any], attach: Callable[..., Any]) -> None:
    """Install the mesh builder and the Accelerator hook (called once, by ``nd_parallel/__init__.py``)."""
    _WIRING.update(build_mesh=build_mesh, attach=attach)


def _wired(name: str) -> Callable[..., Any]:
    fn = _WIRING[name]
    if fn is None:  # only reachable when nd_parallel.config is loaded without the nd_parallel package
        raise RuntimeError(f"nd_parallel.config.accelerate_api: {name} is not connected; import nd_parallel first")
    return fn


@dataclass(kw_only=True)
class AccelerateAPI(Layout):
    """The fields, properties and methods of Accelerate's ParallelismConfig that ours does not already have."""

    sp_size: int = 1
    """Accelerate's DeepSpeed (ALST/Ulysses) sequence parallelism: only 1; use cp_size with cp_backend="ulysses"."""
    sp_backend: str = "deepspeed"
    """Accelerate's sequence-parallel engine; "deepspeed" (its only value), meaning nothing while sp_size=1."""
    tp_handler: Any = None
    """Accelerate's ``TorchTensorParallelConfig``: accepted with ``enable_async_tp=False`` (ours is synchronous)."""
    cp_handler: Any = None
    """Accelerate's ``TorchContextParallelConfig``: accepted with its default ``cp_comm_strategy`` only."""
    sp_handler: Any = None
    """Accelerate's ``DeepSpeedSequenceParallelConfig``: must be None (no DeepSpeed sequence parallelism here)."""

    # A class attribute, as in Accelerate: the mesh get_device_mesh built, per instance once set.
    device_mesh = None

    def _check_accelerate_api(self) -> None:
        if self.sp_size != 1:
            raise ConfigError(
                f"sp_size={self.sp_size!r}: Accelerate's DeepSpeed sequence parallelism (ALST/Ulysses) is not "
                "supported; use cp_size with cp_backend='ulysses' (the same all-to-all over heads) instead")
        if self.sp_backend != "deepspeed":
            raise ConfigError(f"sp_backend={self.sp_backend!r} is not one of Accelerate's values ('deepspeed'); "
                              "drop it (sequence parallelism is context parallelism here: cp_size, cp_backend)")
        if self.sp_handler is not None:
            raise ConfigError(f"sp_handler={self.sp_handler!r} configures DeepSpeed's sequence parallelism, which "
                              "nd_parallel does not run; drop it and use cp_size / cp_backend='ulysses'")
        if getattr(self.tp_handler, "enable_async_tp", False):
            raise ConfigError("tp_handler=TorchTensorParallelConfig(enable_async_tp=True): asynchronous TP "
                              "(micro-pipelined collectives) is not implemented; drop tp_handler or set "
                              "enable_async_tp=False (the same result, computed synchronously)")
        check_cp_comm_strategy(getattr(self.cp_handler, "cp_comm_strategy", None), "cp_handler.cp_comm_strategy")

    # -------------------------------------------------------------- Accelerate's properties
    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        self._require_resolved("dp_shard_enabled")
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def pp_enabled(self) -> bool:
        """Ours only (Accelerate has no pipeline parallelism)."""
        return self.pp_size > 1

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dimensions across which data parallelism is applied (different samples)."""
        return [n for n, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled))
                if on]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions whose ranks receive the same batch: tp, cp (Accelerate's order), then pp."""
        return [n for n, on in (("tp", self.tp_enabled), ("cp", self.cp_enabled), ("pp", self.pp_enabled)) if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dimensions flattened into the mesh FSDP shards over (dp_shard, cp)."""
        return [n for n, on in (("dp_shard", self.dp_shard_enabled), ("cp", self.cp_enabled)) if on]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dimensions across which the loss is averaged (dp_replicate, dp_shard, cp)."""
        return self.dp_dim_names + (["cp"] if self.cp_enabled else [])

    @property
    def fsdp_dim_names(self) -> list[str]:
        """Dimensions FSDP is applied across: dp_replicate (when enabled) and the flattened dp_shard_cp."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def total_size(self) -> int:
        """The number of ranks: the product of every size (pp included)."""
        return self.world_size

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share a batch: tp * cp (* pp, ours); Accelerate's tp * cp * sp with sp = 1."""
        return self.tp_size * self.cp_size * self.pp_size

    @property
    def data_parallel_size(self) -> int:
        """dp_replicate_size * dp_shard_size."""
        return self.dp_size

    # -------------------------------------------------------------- Accelerate's methods
    def build_device_mesh(self, device_type: str):
        """nd_parallel's mesh (``distributed/mesh.py``) as a DeviceMesh: every dimension by name, size-1 ones
        included (``pp, dp_replicate, dp_shard, cp, tp``), and the flattened ``dp``, ``dp_shard_cp``, ``dp_cp``
        that Accelerate's has. Initialises torch.distributed from the launcher's variables when needed, as
        ``init_device_mesh`` does. A collective: every rank calls it."""
        return _wired("build_mesh")(self, device_type)

    def get_device_mesh(self, device_type: str | None = None):
        """The mesh, built on the first call with a device type (Accelerate's contract)."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("You need to pass a device_type e.g cuda to build the device mesh")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(f"the device_mesh was built for device type {self.device_mesh.device_type!r}, not "
                             f"{device_type!r}; build the Accelerator on the device the mesh was built for")
        return self.device_mesh

    def to_json(self) -> str:
        """The fields as JSON (handlers as their repr)."""
        return json.dumps(self.to_dict(), default=repr, sort_keys=True)

    def _validate_accelerator(self, accelerator) -> None:
        """Called by ``Accelerator.__init__``: attach nd_parallel to that Accelerator (accelerate/from_config.py)."""
        _wired("attach")(self, accelerator)


# accelerate's launcher writes PARALLELISM_CONFIG_CP_COMM_STRATEGY=allgather whenever cp_size > 1, and its
# TorchContextParallelConfig fills in the same default: that value says nothing about the user's choice.
ACCELERATE_DEFAULT_CP_COMM_STRATEGY = "allgather"


def check_cp_comm_strategy(value: Any, name: str) -> None:
    """Refuse a context-parallel communication strategy other than Accelerate's own default (see above)."""
    if value is None or value == ACCELERATE_DEFAULT_CP_COMM_STRATEGY:
        return
    known = value in ("allgather", "alltoall")
    raise ConfigError(
        f"{name}={value!r}" + ("" if known else " is not even one of Accelerate's values ('allgather', 'alltoall')")
        + ": it picks how torch's context_parallel rotates K/V, which nd_parallel does not run; its CP moves K/V "
        "with cp_backend='ring' (blocks passed around the cp ranks, the default) or 'ulysses' (all-to-all over "
        "heads). Remove the strategy and choose cp_backend instead")
