"""``Accelerator(parallelism_config=...)``: the Accelerator attaches nd_parallel by itself.

``Accelerator.__init__`` calls ``parallelism_config.get_device_mesh(device_type)`` and then
``parallelism_config._validate_accelerator(self)``. On our ``ParallelismConfig`` the first builds nd_parallel's mesh
(``distributed/device_mesh.py``) and the second lands here: the plugin is attached to that Accelerator, which then
shows our config as ``accelerator.parallelism_config`` and our mesh as ``accelerator.torch_device_mesh``.

Accelerate's own ``ParallelismConfig`` does the same once the user opts in, with ``use_for_accelerate_configs()`` or
``ND_PARALLEL_ACCELERATE=1`` in the environment of a process that imports nd_parallel: its two methods are then
routed here (a patch of Accelerate's class, made only on that request), its sizes become ours, and the layout
options Accelerate does not have (pp_size, ...) are read from PARALLELISM_CONFIG_* as ours are.
"""

from __future__ import annotations

import logging
import os

from nd_parallel.config import ConfigError, ParallelismConfig
from nd_parallel.distributed.device_mesh import parallel_mesh_of

from .accelerate_config import SHARED_SIZES, left_by_earlier_plugin, refuse_different_sizes
from .plugin import NDParallelPlugin

OPT_IN_ENV = "ND_PARALLEL_ACCELERATE"
logger = logging.getLogger("nd_parallel")


def attach_from_config(config: ParallelismConfig, accelerator) -> NDParallelPlugin | None:
    """Our config's ``_validate_accelerator``: attach (or find) the plugin of this Accelerator.

    None when ``config`` is the one an earlier plugin left on Accelerate's process-wide ``AcceleratorState``
    (``accelerate_config.show``): a later ``Accelerator()`` of the same process, which Accelerate hands that state,
    did not ask for it; a script that trains several layouts in turn attaches the next plugin itself."""
    if left_by_earlier_plugin(config, accelerator):
        return None
    undo_trainer_overwrite(config)
    existing = getattr(accelerator, "nd_parallel", None)
    if existing is not None:
        refuse_different_sizes(existing.config, config, "the plugin already attached", "this ParallelismConfig")
        return existing
    return NDParallelPlugin(config).attach(accelerator)


def undo_trainer_overwrite(config: ParallelismConfig) -> None:
    """The sizes this config's mesh was built with, where something changed them in between.

    ``Trainer`` overwrites ``parallelism_config.tp_size`` / ``dp_shard_size`` with the sharding transformers used when
    the model was loaded with ``tp_plan`` (5.24 shards over every rank, whatever ``device_mesh`` says). That model is
    gathered back at prepare (``distributed/transformers_tp.py``), so the layout the user built the mesh for stands.
    """
    mesh = parallel_mesh_of(config)
    if mesh is None:
        return
    changed = {n: (getattr(mesh.config, n), getattr(config, n)) for n in SHARED_SIZES + ("pp_size",)
               if getattr(config, n) not in (getattr(mesh.config, n), -1)}
    if changed:
        logger.warning("ParallelismConfig was changed after build_device_mesh (%s), by the Trainer for a model "
                       "transformers sharded at load; keeping the layout the mesh was built for",
                       ", ".join(f"{n} {a}->{b}" for n, (a, b) in changed.items()))
        for name, (built, _) in changed.items():
            setattr(config, name, built)


def from_accelerate(pc) -> ParallelismConfig:
    """Ours with the sizes and handlers of Accelerate's ``ParallelismConfig``; unset options from PARALLELISM_CONFIG_*.

    Accelerate's cp_backend can only be "torch" (its torch context_parallel, which it always names): like the
    launcher's CP_BACKEND=torch it says nothing about a choice, so our default CP backend (ring) runs.
    """
    if isinstance(pc, ParallelismConfig):
        return pc
    kwargs = {n: getattr(pc, n) for n in SHARED_SIZES}
    kwargs.update(tp_handler=getattr(pc, "tp_handler", None), cp_handler=getattr(pc, "cp_handler", None),
                  sp_size=getattr(pc, "sp_size", 1) or 1, sp_handler=getattr(pc, "sp_handler", None))
    return ParallelismConfig(**kwargs)


def use_for_accelerate_configs() -> None:
    """Route Accelerate's own ``ParallelismConfig`` to nd_parallel in this process (see the module docstring)."""
    from accelerate.parallelism_config import ParallelismConfig as Theirs

    if getattr(Theirs, "_nd_parallel_routed", False):
        return

    def ours(self) -> ParallelismConfig:
        if "_nd_parallel_config" not in self.__dict__:
            self.__dict__["_nd_parallel_config"] = from_accelerate(self)
        return self.__dict__["_nd_parallel_config"]

    Theirs.get_device_mesh = lambda self, device_type=None: ours(self).get_device_mesh(device_type)
    Theirs._validate_accelerator = lambda self, accelerator: attach_from_config(ours(self), accelerator)
    Theirs._nd_parallel_routed = True


def opt_in_from_env(environ=None) -> None:
    """``ND_PARALLEL_ACCELERATE=1``: ``use_for_accelerate_configs()`` when nd_parallel is imported."""
    env = os.environ if environ is None else environ
    value = env.get(OPT_IN_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        use_for_accelerate_configs()
    elif value not in ("", "0", "false", "no", "off"):
        raise ConfigError(f"{OPT_IN_ENV}={env[OPT_IN_ENV]!r} is not a boolean; set {OPT_IN_ENV}=1 to route "
                          "Accelerate's ParallelismConfig to nd_parallel, or unset it")
