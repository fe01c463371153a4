"""`ParallelismConfig`: the degrees and options of an N-D parallel layout, validated before any process group exists.

The class is composed from one mixin per group of options (layout.py, tensor_parallel.py, expert_parallel.py,
pipeline.py, context_parallel.py, activation_checkpointing.py, compile.py, memory.py, fault.py, checkpoint.py,
loss.py), so that an option and its check live together; the constructor stays flat. Build it from keyword arguments,
or from a dict, YAML or the environment with the readers of sources.py, which also states the precedence between them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import sources
from .accelerate_api import AccelerateAPI
from .activation_checkpointing import ActivationCheckpointingOptions
from .checkpoint import CheckpointOptions
from .checks import ConfigError
from .compile import CompileOptions
from .context_parallel import ContextParallelOptions
from .expert_parallel import ExpertParallelOptions
from .fault import FaultOptions
from .layout import SIZE_FIELDS, Layout
from .loss import LossOptions
from .memory import MemoryOptions
from .pipeline import PipelineOptions
from .tensor_parallel import TensorParallelOptions


# Fields are collected from the bases last to first, so this list, read backwards, is the field order (and the order
# asdict, to_dict and describe follow): the layout first, the checkpoint option, then Accelerate's own fields last.
# Like Accelerate's, the constructor reads PARALLELISM_CONFIG_* for every setting not given (sources.reads_env_for_unset).
@sources.reads_env_for_unset
@dataclass(kw_only=True)
class ParallelismConfig(AccelerateAPI, LossOptions, CheckpointOptions, FaultOptions, MemoryOptions, CompileOptions,
                        ActivationCheckpointingOptions, ContextParallelOptions, PipelineOptions, ExpertParallelOptions,
                        TensorParallelOptions, Layout):
    """Sizes of the five parallel dimensions and the options of their backends."""

    def __post_init__(self) -> None:
        # When several settings are wrong, the first one in this order is reported; the order predates the split
        # into groups, which is why the pipeline and fault groups each check in more than one step.
        self._check_layout()
        self._check_pipeline_counts()
        self._check_tensor_parallel()
        self._check_expert_parallel()
        self._check_pipeline_choices()
        self._check_context_parallel()
        self._check_activation_checkpointing()
        self._check_compile()
        self._check_memory()
        self._check_fault()
        self._check_checkpoint()
        self._check_nonfinite()
        self._check_pipeline()
        self._check_loss()
        self._check_accelerate_api()

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (copies; safe to modify)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line: the sizes, the world size, and any option that differs from its default."""
        parts = [f"{dim}={size}" for dim, size in self.sizes.items()]
        parts.append("(world unresolved)" if self.dp_shard_size == -1
                     else f"(world {self.world_size})")
        parts += [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if f.name not in SIZE_FIELDS and getattr(self, f.name) != f.default]
        return " ".join(parts)

    def __str__(self) -> str:
        return self.describe()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "config") -> ParallelismConfig:
        """Build from a mapping of field names or Axolotl's aliases (see PARALLEL_KEYS); see sources.from_dict."""
        return sources.from_dict(cls, d, source=source)

    @classmethod
    def merge(cls, *layers: Mapping[str, Any], source: str = "merged config") -> ParallelismConfig:
        """Build from mappings given lowest precedence first, e.g. merge(env, yaml, cli); see sources.merge."""
        return sources.merge(cls, *layers, source=source)

    @classmethod
    def from_yaml(cls, path_or_text: str | os.PathLike, *, source: str | None = None) -> ParallelismConfig:
        """Build from a YAML file path, or from YAML text; plain values only (yaml.safe_load)."""
        return sources.from_yaml(cls, path_or_text, source=source)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ParallelismConfig:
        """Build from PARALLELISM_CONFIG_* (default os.environ); unset ones keep their defaults."""
        return sources.from_env(cls, environ)

    env_overrides = staticmethod(sources.env_overrides)

    @classmethod
    def auto(cls, model: Any, *, seq_len: int, global_batch: int, world_size: int | None = None,
             gpus_per_node: int | None = None, gpu_memory: int | str | None = None, dtype: str = "bf16",
             lora_rank: int | None = None, **cluster: Any) -> ParallelismConfig:
        """The layout planner's top plan (nd_parallel.planner) for the ranks actually launched.

        `model`: a checkpoint directory, a config.json, a model (meta or real) or a planner ModelSpec.
        `world_size` defaults to WORLD_SIZE and `gpus_per_node` to LOCAL_WORLD_SIZE (both set by the launcher),
        `gpu_memory` to the device's memory ("80GiB" or bytes); `cluster` passes the planner's Cluster fields
        (intra_bw, inter_bw, flops, ...). The chosen plan (micro-batch, accumulation, predicted peak memory and
        step time) is kept as `config.plan`. A request nothing fits raises ConfigError with the planner's hint.
        """
        # The one deliberate upward import out of config/: `auto` is the public front door to the planner layer.
        from nd_parallel.planner import PlannerError
        from nd_parallel.planner.auto import config_kwargs, fields_of, top_plan

        # The launcher's variables, read here for the defaults so that `auto` plans for the ranks actually launched.
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        try:
            plan = top_plan(model, world_size=world, seq_len=seq_len, global_batch=global_batch,
                            gpus_per_node=per_node, gpu_memory=gpu_memory, dtype=dtype, lora_rank=lora_rank, **cluster)
            config = cls(**config_kwargs(plan, fields_of(cls)))
        except PlannerError as err:
            raise ConfigError(f"ParallelismConfig.auto: {err}") from None
        config.plan = plan
        return config


PARALLEL_KEYS: frozenset[str] = sources.parallel_keys(ParallelismConfig)
"""Every key from_dict accepts: the field names plus Axolotl's aliases."""

# Fault and checkpoint options say how a run reacts to faults, not what the layout is: `layout: auto` keeps them from
# the YAML. Taken from the two groups so that an option added to either is one too.
RUN_OPTIONS = tuple(f.name for group in (FaultOptions, CheckpointOptions) for f in dataclasses.fields(group))
