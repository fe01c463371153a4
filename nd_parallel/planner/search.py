"""Every legal layout of a cluster, each with its best knobs, ranked by predicted step time.

How the search is pruned (it runs in well under a second for thousands of GPUs):
1. Sizes: tp, cp and pp run over the divisors of the world size only, dp is what is left, and each dp splits
   into dp_replicate x dp_shard over its divisors. Rules that need no cost model reject a layout at once,
   with the reason (heads vs tp, tp x cp beyond one node, the ring's 2*cp chunks vs the sequence, layers vs
   pipeline stages, the global batch vs dp).
2. A layout whose model states alone (params, grads, AdamW) exceed the memory is rejected before any knob.
3. Knobs: micro-batch sizes over the divisors of the per-rank batch; for pp > 1 the schedules the layer count
   and micro-batch count allow; checkpointing tried none -> selective -> full, stopping at the first that
   fits (a stronger mode only adds recomputation, so the ones after it cannot be faster).
4. Only the fastest setting of each layout is kept, so the ranking lists distinct layouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from .errors import PlannerError
from .layout import CHECKPOINTING, Cluster, Layout, Training
from .memory import RankMemory, peak_memory
from .spec import ModelSpec
from .timing import step_time
from .units import format_bytes

SIZE_NAMES = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv", "gpipe")


@dataclass(frozen=True)
class Constraints:
    """What the user pins; None leaves a knob to the search."""

    sizes: dict[str, int] = field(default_factory=dict)
    """Pinned sizes by name: dp_replicate, dp_shard, tp, cp, pp, ep (ep borrows dp_shard's ranks: no rank of its own)."""
    micro_batch: int | None = None
    schedule: str | None = None
    checkpointing: str | None = None
    cp_backend: str = "ring"
    """"ring" (any head count) or "ulysses" (heads per tp rank divisible by cp)."""
    cross_node_tp: bool = False
    """Allow tp x cp groups that span nodes (they talk every layer; off by default)."""


@dataclass
class Plan:
    """A layout with its predicted peak memory (busiest rank) and step time."""

    layout: Layout
    memory: RankMemory
    time: dict[str, float]

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    @property
    def dominant(self) -> str:
        return max(self.time, key=self.time.get)


@dataclass
class PlanResult:
    """The ranked plans, the rejected layouts with reasons, and a hint."""

    spec: ModelSpec
    train: Training
    cluster: Cluster
    plans: list[Plan]
    rejected: list[tuple[dict, str]]
    hint: str
    evaluated: int
    seconds: float


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def size_rule(spec: ModelSpec, train: Training, cluster: Cluster, lay: Layout, cons: Constraints) -> str | None:
    """Why a layout's sizes cannot run, or None. No cost model involved."""
    for label, heads in (("num_attention_heads", spec.heads), ("num_key_value_heads", spec.kv_heads)):
        if heads % lay.tp:
            return f"tp_size={lay.tp} does not divide {label}={heads}; tp must be in {divisors(heads)}"
    if lay.tp * lay.cp > cluster.gpus_per_node and not cons.cross_node_tp:
        return (f"tp x cp = {lay.tp * lay.cp} ranks exceed one node ({cluster.gpus_per_node} GPUs): they talk every "
                "layer, so they stay inside a node (allow with --cross-node-tp)")
    if lay.cp > 1 and train.seq_len < 2 * lay.cp:
        return f"the ring cuts the sequence into 2*cp = {2 * lay.cp} chunks, more than seq_len={train.seq_len} tokens"
    if lay.cp > 1 and cons.cp_backend == "ulysses" and (spec.heads // lay.tp % lay.cp or spec.kv_heads // lay.tp % lay.cp):
        return (f"cp_backend='ulysses' needs heads/tp={spec.heads // lay.tp} and kv_heads/tp="
                f"{spec.kv_heads // lay.tp} divisible by cp_size={lay.cp}")
    if lay.pp > spec.num_layers:
        return f"pp_size={lay.pp} stages but the model has {spec.num_layers} layers"
    if train.global_batch % lay.dp:
        return f"global batch {train.global_batch} does not split over dp = {lay.dp} data-parallel ranks"
    return None


def _schedules(spec: ModelSpec, lay: Layout, m: int, cons: Constraints) -> list[tuple[str | None, int]]:
    """(schedule, virtual stages) pairs this layout and micro-batch count can run."""
    if lay.pp == 1:
        return [(None, 1)]
    out = []
    for name in (cons.schedule,) if cons.schedule else PP_SCHEDULES:
        virtual = 2 if name in ("interleaved-1f1b", "zbv") else 1
        if name != "gpipe" and m < lay.pp:
            continue  # 1F1B-style schedules need a micro-batch per stage
        if lay.pp * virtual > spec.num_layers:
            continue
        out.append((name, virtual))
    return out


def _layouts(world: int, cons: Constraints, experts: int = 0):
    """Every split of `world`; for a MoE model (`experts` > 0) each ep size that divides both dp_shard (ep borrows
    its ranks) and the expert count."""
    for tp in divisors(world):
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                for rep in divisors(dp):
                    for ep in [e for e in divisors(dp // rep) if experts and experts % e == 0] or [1]:
                        lay = Layout(dp_replicate=rep, dp_shard=dp // rep, tp=tp, cp=cp, pp=pp, ep=ep)
                        if all(getattr(lay, k) == v for k, v in cons.sizes.items()):
                            yield lay


def best_setting(spec, train, cluster, lay: Layout, cons: Constraints) -> tuple[Plan | None, RankMemory, int]:
    """The fastest fitting knob setting of `lay`, the smallest peak seen (for reasons and hints), evaluations."""
    per_rank = train.global_batch // lay.dp
    micro = [cons.micro_batch] if cons.micro_batch else divisors(per_rank)
    modes = [cons.checkpointing] if cons.checkpointing else list(CHECKPOINTING)
    best: Plan | None = None
    smallest: RankMemory | None = None
    evaluated = 0
    for mb in micro:
        if per_rank % mb:
            continue
        m = per_rank // mb
        for schedule, virtual in _schedules(spec, lay, m, cons):
            for mode in modes:
                cand = replace(lay, micro_batch=mb, microbatches=m, schedule=schedule, virtual=virtual,
                               checkpointing=mode)
                mem = peak_memory(spec, train, cand, cluster)
                evaluated += 1
                if smallest is None or mem.peak < smallest.peak:
                    smallest = mem
                if mem.peak <= cluster.gpu_memory:
                    plan = Plan(cand, mem, step_time(spec, train, cand, cluster))
                    if best is None or plan.step_time < best.step_time:
                        best = plan
                    break  # a stronger checkpointing mode only adds recomputation
    return best, smallest, evaluated


def search(spec: ModelSpec, train: Training, cluster: Cluster, cons: Constraints = Constraints()) -> PlanResult:
    """Rank every legal layout of `cluster` for training `spec` as `train` describes (see the module docstring).
    Callers holding a model or a path rather than a ModelSpec go through `plan` (entry.py)."""
    start = time.perf_counter()
    check_inputs(spec, train, cluster, cons)
    plans, rejected, closest, evaluated = [], [], None, 0
    for lay in _layouts(cluster.world, cons, spec.num_experts):
        reason = size_rule(spec, train, cluster, lay, cons)
        if reason is None:
            plan, smallest, n = best_setting(spec, train, cluster, lay, cons)
            evaluated += n
            if smallest is None:
                reason = "no micro-batch / schedule setting applies (pinned values exclude them all)"
            elif plan is None:
                if closest is None or smallest.peak < closest.peak:
                    closest = smallest
                reason = (f"needs {format_bytes(smallest.peak)} per GPU at best ({_knobs(smallest.layout)}) > "
                          f"{format_bytes(cluster.gpu_memory)}")
            else:
                plans.append(plan)
        if reason:
            rejected.append((lay.sizes(), reason))
    plans.sort(key=lambda p: (p.step_time, p.memory.peak))
    if not plans and closest is None:  # every layout broke a rule: no memory figure to hint with
        raise PlannerError(_no_legal_layout(cluster, cons, rejected))
    hint = _hint(spec, train, cluster, cons, plans, closest)
    return PlanResult(spec, train, cluster, plans, rejected, hint, evaluated, time.perf_counter() - start)


def _knobs(lay: Layout) -> str:
    bits = [f"micro-batch {lay.micro_batch} x {lay.microbatches}"]
    if lay.schedule:
        bits.append(lay.schedule)
    return ", ".join(bits + ["no checkpointing" if lay.checkpointing == "none" else f"{lay.checkpointing} checkpointing"])


def check_inputs(spec: ModelSpec, train: Training, cluster: Cluster, cons: Constraints) -> None:
    """Refuse impossible requests and contradictory pins with one message each."""
    for name, value in (("--nodes", cluster.nodes), ("--gpus-per-node", cluster.gpus_per_node),
                        ("--seq-len", train.seq_len), ("--global-batch", train.global_batch)):
        if not isinstance(value, int) or value < 1:
            raise PlannerError(f"{name}={value!r} must be a positive integer")
    if cluster.gpu_memory <= 0:
        raise PlannerError(f"--gpu-memory={cluster.gpu_memory} must be positive, e.g. 80GiB")
    if train.lora_rank is not None and (train.lora_rank < 1 or not spec.lora_linears):
        raise PlannerError(f"--lora-rank={train.lora_rank}: needs a rank >= 1 and Linears to adapt in the layers")
    pinned = 1
    for name, value in cons.sizes.items():
        if name not in SIZE_NAMES or value < 1:
            raise PlannerError(f"pinned {name}={value}: pin dp_replicate, dp_shard, tp, cp, pp or ep to a positive size")
        pinned *= value if name != "ep" else 1
    if cluster.world % pinned:
        shown = " x ".join(f"{k}={v}" for k, v in cons.sizes.items())
        raise PlannerError(f"the pinned sizes {shown} = {pinned} ranks do not divide the {cluster.world} GPUs "
                           f"({cluster.nodes} nodes x {cluster.gpus_per_node}); pin sizes whose product divides "
                           f"{cluster.world}")
    if cons.sizes.get("pp", 1) == 1 and cons.schedule:
        raise PlannerError(f"--schedule {cons.schedule} pins a pipeline schedule but pp is pinned to 1; drop one")
    if cons.micro_batch and train.global_batch % cons.micro_batch:
        raise PlannerError(f"--micro-batch {cons.micro_batch} does not divide --global-batch {train.global_batch}")


def _no_legal_layout(cluster: Cluster, cons: Constraints, rejected) -> str:
    reasons = sorted({r for _, r in rejected})
    pins = ", ".join(f"{k}={v}" for k, v in cons.sizes.items()) or "none"
    return (f"no layout of {cluster.world} GPUs is legal for this model and batch (pinned: {pins}); reasons: "
            + "; ".join(reasons[:4]) + ("; ..." if len(reasons) > 4 else "")
            + ". Change the pins, the global batch (a multiple of the data-parallel size) or the GPU count")


def _hint(spec, train, cluster, cons, plans: list[Plan], closest: RankMemory | None) -> str:
    if plans:
        best = plans[0]
        return (f"{len(plans)} layouts fit; the fastest is {best.layout.name()} ({_knobs(best.layout)}), "
                f"{format_bytes(best.memory.peak)} peak, dominated by {best.dominant}")
    lay = closest.layout
    parts = closest.parts
    biggest = max(parts, key=parts.get)
    knobs = _knob_effects(spec, train, cluster, cons)
    best_knob = min(knobs, key=lambda k: k[1]) if knobs else None
    text = (f"nothing fits in {format_bytes(cluster.gpu_memory)}: the closest layout, {lay.name()} "
            f"({_knobs(lay)}), needs {format_bytes(closest.peak)} per GPU, most of it {biggest} "
            f"({format_bytes(parts[biggest])})")
    if best_knob:
        text += f"; the knob that helps most: {best_knob[0]} (-> {format_bytes(best_knob[1])} per GPU)"
    return text


def _knob_effects(spec, train, cluster, cons) -> list[tuple[str, int]]:
    """The smallest peak reachable after changing one knob at a time."""
    def smallest(spec_, train_, cluster_) -> int | None:
        peaks = []
        for lay in _layouts(cluster_.world, cons):
            if size_rule(spec_, train_, cluster_, lay, cons) is None:
                _, mem, _ = best_setting(spec_, train_, replace(cluster_, gpu_memory=0), lay, cons)
                if mem is not None:
                    peaks.append(mem.peak)
        return min(peaks) if peaks else None

    trials = [(f"twice the GPUs (--nodes {2 * cluster.nodes})", spec, train, replace(cluster, nodes=2 * cluster.nodes))]
    if train.lora_rank is None:
        trials.append(("LoRA instead of full fine-tuning (--lora-rank 16)", spec, replace(train, lora_rank=16), cluster))
    if train.seq_len > 1:
        trials.append((f"half the sequence (--seq-len {train.seq_len // 2})", spec,
                       replace(train, seq_len=train.seq_len // 2), cluster))
    out = []
    for label, s, t, c in trials:
        peak = smallest(s, t, c)
        if peak is not None:
            out.append((label, peak))
    return out


def scale_lr(lr: float, batch: int, base_batch: int, rule: str) -> float:
    """The learning rate for `batch` given one tuned at `base_batch`: linear (Goyal et al.) or sqrt scaling."""
    if rule not in ("linear", "sqrt"):
        raise PlannerError(f"lr_scaling={rule!r}: use 'linear' or 'sqrt'")
    if base_batch < 1:
        raise PlannerError(f"base_batch_size={base_batch} must be a positive number of samples")
    ratio = batch / base_batch
    return lr * (ratio if rule == "linear" else ratio ** 0.5)
