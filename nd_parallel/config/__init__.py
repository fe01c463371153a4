"""What a run is asked to do, validated before any process group exists: the layout and its options.

``ParallelismConfig`` (parallelism.py) holds the sizes of the parallel dimensions and the options of each, one module
per group of options (layout.py, tensor_parallel.py, pipeline.py, context_parallel.py, activation_checkpointing.py,
fault.py, checkpoint.py); it is built from keyword arguments, a dict or YAML (with Axolotl's key names), or
``accelerate launch``'s ``PARALLELISM_CONFIG_*`` variables (sources.py). checks.py holds the errors and value checks.
"""

from .activation_checkpointing import AC_MODES, check_activation_checkpointing
from .checks import ConfigError, ConfigTypeError
from .context_parallel import CP_BACKENDS
from .layout import SIZE_FIELDS
from .parallelism import PARALLEL_KEYS, RUN_OPTIONS, ParallelismConfig
from .pipeline import PP_BACKENDS, PP_SCHEDULES
from .sources import AXOLOTL_ALIASES

__all__ = ["AC_MODES", "AXOLOTL_ALIASES", "CP_BACKENDS", "PARALLEL_KEYS", "PP_BACKENDS", "PP_SCHEDULES", "RUN_OPTIONS",
           "SIZE_FIELDS", "ConfigError", "ConfigTypeError", "ParallelismConfig", "check_activation_checkpointing"]
