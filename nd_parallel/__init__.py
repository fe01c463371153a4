"""nd_parallel: HSDP, TP, CP and pipeline parallelism for any Hugging Face causal LM, from Accelerate.

Public API only; the layers below are described in docs/architecture.md.
"""

import os as _os

from .config import ParallelismConfig
from .config import accelerate_api as _accelerate_api
from .version import __version__

__all__ = ["ParallelismConfig", "NDParallelPlugin", "__version__"]


# ParallelismConfig has Accelerate's API: its build_device_mesh and the hook Accelerator() calls reach layers above
# config/ (the core never imports the integrations), so this package, which may import any layer, connects them.
# Both import lazily, keeping `import nd_parallel` fast in every rank.
# Both run before the script's from_pretrained in Accelerate's examples (Accelerator() builds the mesh, then
# attaches): adopt_launcher_env turns the launcher's FSDP_CPU_RAM_EFFICIENT_LOADING off there, so from_pretrained
# gives every rank the checkpoint's weights, which nd_parallel's prepare expects (it broadcasts none).
# The mesh is built again when the Trainer (Accelerator(), get_device_mesh) asks for it after overwriting the sizes
# for a model transformers sharded at load: undo_trainer_overwrite restores the layout the first mesh was built for.
def _build_device_mesh(config, device_type):
    from .accelerate.from_config import undo_trainer_overwrite
    from .accelerate.launcher_env import adopt_launcher_env
    from .distributed.device_mesh import build_device_mesh

    adopt_launcher_env()
    undo_trainer_overwrite(config)
    return build_device_mesh(config, device_type)


def _attach_to_accelerator(config, accelerator):
    from .accelerate.from_config import attach_from_config
    from .accelerate.launcher_env import adopt_launcher_env
    from .plugins.trainer.adopt import adopt_constructing_trainer

    adopt_launcher_env()
    plugin = attach_from_config(config, accelerator)
    if plugin is not None:
        adopt_constructing_trainer(accelerator, plugin)  # a Trainer building this Accelerator gets its habits turned


_accelerate_api.connect(build_mesh=_build_device_mesh, attach=_attach_to_accelerator)
if _os.environ.get("ND_PARALLEL_ACCELERATE"):
    from .accelerate.from_config import opt_in_from_env

    opt_in_from_env()


def __getattr__(name):
    # The plugin pulls in accelerate and transformers (seconds per process): import it only when asked for, so
    # submodules such as the attention kernels or the config load fast in every rank.
    if name == "NDParallelPlugin":
        from .accelerate import NDParallelPlugin

        return NDParallelPlugin
    raise AttributeError(f"module 'nd_parallel' has no attribute {name!r}")
