"""nd_parallel: HSDP, TP, CP and pipeline parallelism for any Hugging Face causal LM, from Accelerate.

Public API only; the layers below are described in docs/architecture.md.
"""

from .config import ParallelismConfig
from .version import __version__

__all__ = ["ParallelismConfig", "NDParallelPlugin", "__version__"]


def __getattr__(name):
    # The plugin pulls in accelerate and transformers (seconds per process): import it only when asked for, so
    # submodules such as the attention kernels or the config load fast in every rank.
    if name == "NDParallelPlugin":
        from .accelerate import NDParallelPlugin

        return NDParallelPlugin
    raise AttributeError(f"module 'nd_parallel' has no attribute {name!r}")
