"""The layout planner: memory and step-time models of a Hugging Face causal LM under the five dimensions, and
the search that ranks every legal layout of a cluster. Pure: no process group, no weights, no GPU.

    spec = spec_from_path("path/to/model")                       # meta-device model, no weights read
    result = search(spec, Training(seq_len=4096, global_batch=64), Cluster(nodes=2, gpus_per_node=8,
                                                                            gpu_memory=parse_bytes("80GiB")))
    result.plans[0].layout, result.plans[0].memory.peak, result.plans[0].step_time

`nd-parallel plan` (plan_cli.py) prints it; `ParallelismConfig.auto` and `layout: auto` use the top plan.
"""

from .layout import CHECKPOINTING, Cluster, Layout, Training
from .memory import RankMemory, peak_memory, rank_memory
from .render import plan_fields, table, to_json, yaml_blocks
from .search import Constraints, Plan, PlanResult, scale_lr, search
from .spec import ModelSpec, PlannerError, model_spec, spec_from_path
from .timing import step_time
from .units import UnitError, format_bytes, parse_bandwidth, parse_bytes, parse_flops

__all__ = ["CHECKPOINTING", "Cluster", "Constraints", "Layout", "ModelSpec", "Plan", "PlanResult", "PlannerError",
           "RankMemory", "Training", "UnitError", "format_bytes", "model_spec", "parse_bandwidth", "parse_bytes",
           "parse_flops", "peak_memory", "plan_fields", "rank_memory", "scale_lr", "search", "spec_from_path",
           "step_time", "table", "to_json", "yaml_blocks"]
