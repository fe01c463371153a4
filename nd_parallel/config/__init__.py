"""What a run is asked to do, validated before any process group exists: the layout and its options.

``ParallelismConfig`` (parallelism.py) holds the sizes of the parallel dimensions and the options of each; it is
built from keyword arguments, a dict or YAML (with Axolotl's key names), or ``accelerate launch``'s
``PARALLELISM_CONFIG_*`` variables.
"""

from .parallelism import (
    AC_MODES,
    AXOLOTL_ALIASES,
    CP_BACKENDS,
    PARALLEL_KEYS,
    PP_BACKENDS,
    PP_SCHEDULES,
    RUN_OPTIONS,
    SIZE_FIELDS,
    ConfigError,
    ConfigTypeError,
    ParallelismConfig,
    check_activation_checkpointing,
)

__all__ = ["AC_MODES", "AXOLOTL_ALIASES", "CP_BACKENDS", "PARALLEL_KEYS", "PP_BACKENDS", "PP_SCHEDULES", "RUN_OPTIONS",
           "SIZE_FIELDS", "ConfigError", "ConfigTypeError", "ParallelismConfig", "check_activation_checkpointing"]
