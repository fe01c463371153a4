"""nd_parallel: HSDP, TP, CP and pipeline parallelism for any Hugging Face causal LM, from Accelerate."""

from .config import ParallelismConfig
from .plugin import NDParallelPlugin

__version__ = "0.1.0"
__all__ = ["ParallelismConfig", "NDParallelPlugin", "__version__"]
