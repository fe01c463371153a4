"""The layout planner: memory and step-time models of a Hugging Face causal LM under the five dimensions, and
the search that ranks every legal layout of a cluster. Pure: no process group, no weights, no GPU.

One entry point, `plan` (entry.py): the model as a local checkpoint directory or config.json (built on the meta
device, no weights read), a causal LM module, or a ModelSpec already read:

    result = plan("path/to/model", Training(seq_len=4096, global_batch=64),
                  Cluster(nodes=2, gpus_per_node=8, gpu_memory=parse_bytes("80GiB")), Constraints(sizes={"tp": 2}))
    result.plans[0].layout, result.plans[0].memory.peak, result.plans[0].step_time

It returns the ranked plans, the rejected layouts with their reasons, and a hint; PlannerError when the request
itself is impossible. `nd-parallel plan` (nd_parallel/cli/plan.py) prints the result with `table`, `to_json` and
`yaml_blocks`; `ParallelismConfig.auto` and `layout: auto` take its top plan through `auto.top_plan`.

The pieces below it stay importable (the tests and the validation benchmark price single layouts with them):
`spec_from_path` / `model_spec` read a ModelSpec, `peak_memory` and `step_time` price one Layout, `search` ranks
the layouts of a ModelSpec. Modules import only downwards: errors, units, layout -> meta -> ops -> spec ->
memory -> timing -> search -> entry -> auto, render (measure stands apart: it measures, the others predict).
"""

from .entry import plan, spec_of
from .errors import PlannerError
from .layout import CHECKPOINTING, Cluster, Layout, Training
from .memory import RankMemory, peak_memory, rank_memory
from .meta import load_config, meta_model
from .render import plan_fields, table, to_json, yaml_blocks
from .search import PP_SCHEDULES, Constraints, Plan, PlanResult, scale_lr, search
from .spec import ModelSpec, model_spec, spec_from_path
from .timing import step_time
from .units import UnitError, format_bytes, parse_bandwidth, parse_bytes, parse_flops

__all__ = ["CHECKPOINTING", "PP_SCHEDULES", "Cluster", "Constraints", "Layout", "ModelSpec", "Plan", "PlanResult",
           "PlannerError", "RankMemory", "Training", "UnitError", "format_bytes", "load_config", "meta_model",
           "model_spec", "parse_bandwidth", "parse_bytes", "parse_flops", "peak_memory", "plan", "plan_fields",
           "rank_memory", "scale_lr", "search", "spec_from_path", "spec_of", "step_time", "table", "to_json",
           "yaml_blocks"]
