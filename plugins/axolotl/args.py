"""The YAML keys the plugin adds to Axolotl's schema (``get_input_args``). Axolotl 0.19 drops, without a word, every
key no plugin declares, so the pipeline and CP options must be declared here to reach the plugin. Axolotl's own
``dp_shard_size``, ``dp_replicate_size``, ``tensor_parallel_size`` and ``context_parallel_size`` keep their names.

Kept free of torch and nd_parallel imports: Axolotl imports it while it validates the config.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class NDParallelArgs(BaseModel):
    """nd_parallel's layout options, as in ParallelismConfig (docs/architecture.md); None = nd_parallel's default."""

    pipeline_parallel_size: int | None = Field(default=None, description="pipeline stages (pp_size)")
    pp_schedule: str | None = Field(default=None, description="1f1b (default), gpipe, interleaved-1f1b, ...")
    pp_microbatches: int | None = Field(default=None, description="micro-batches per schedule run (default pp)")
    pp_virtual_stages: int | None = Field(default=None, description="stages per rank (>1: interleaved)")
    pp_backend: str | None = Field(default=None, description="torch (default) or deepspeed")
    pp_balance: str | list[int] | None = Field(default=None, description="uniform, profile or layers per stage")
    cp_backend: str | None = Field(default=None, description="ring (default), ulysses, torch (CUDA)")
    cp_load_balance: bool | None = Field(default=None, description="zig-zag sequence split (default true)")
