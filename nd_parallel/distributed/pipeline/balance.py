"""Pipeline balance: how many decoder layers each stage gets, from measured per-unit costs.

A model is seen as a chain of *units* in execution order: the embedding (every ``pre`` module), one unit per
decoder layer, and the head (every ``post`` module plus the loss). The embedding is pinned to the first
stage and the head to the last; only the layers move. Three steps, each usable on its own:

    partition(costs, S)        pure: the contiguous split minimising the slowest stage (exact DP)
    profile_layers(model, b)   measures every unit's forward+backward time and memory on this rank
    agree_costs(costs, group)  every rank takes the same median of every rank's measurements

``profile_balance`` chains them for ``pp_balance="profile"``. It runs at prepare time, on the whole model,
before the split: the stages (and so the optimizer's parameters) must exist when ``prepare`` returns, so the
real micro-batch is not known yet. It profiles a sample of ``(1, min(max_position_embeddings, 512))``
tokens unless told otherwise; what matters is the *ratio* of unit costs, and the embedding, the layers'
linear layers and the head all scale with the token count alike (only attention's quadratic part does not).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from nd_parallel.models.hf import ModelParts, model_parts, text_config

from .split import check_layer_counts, uniform_layers

logger = logging.getLogger(__name__)

DEFAULT_PROFILE_SEQ = 512


# ----------------------------------------------------------------------------------------- pure partition
@dataclass(frozen=True)
class BalancePlan:
    """A split and what it is predicted to cost."""

    counts: list[int]  # decoder layers per stage
    stage_seconds: list[float]  # predicted forward+backward time of each stage for one micro-batch

    @property
    def bottleneck(self) -> float:
        return max(self.stage_seconds)

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage: 1.0 is perfect balance."""
        return self.bottleneck / (sum(self.stage_seconds) / len(self.stage_seconds))


def stage_times(costs: list[float], counts: list[int]) -> list[float]:
    """Per-stage cost of a split; ``costs`` = [embedding, layer 0 .. layer N-1, head]."""
    layers = costs[1:-1]
    out, start = [], 0
    for stage, count in enumerate(counts):
        total = sum(layers[start : start + count])
        start += count
        if stage == 0:
            total += costs[0]
        if stage == len(counts) - 1:
            total += costs[-1]
        out.append(total)
    return out


def _check_costs(costs: list[float], num_stages: int) -> int:
    num_layers = len(costs) - 2
    if num_layers < 1:
        raise ValueError(f"costs must be [embedding, layer costs..., head]; got {len(costs)} values")
    if any(not c >= 0 for c in costs):  # `not >=` also catches NaN
        raise ValueError(f"unit costs must be finite and >= 0, got {costs}")
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages; use 1 to {num_layers} stages")
    return num_layers


def partition(costs: list[float], num_stages: int, *, rtol: float = 0.0, allow_empty_ends: bool = True) -> BalancePlan:
    """Split the layers into ``num_stages`` contiguous stages so that the slowest stage is as fast as possible.

    ``costs`` = [embedding, layer 0 .. layer N-1, head], in any unit of time. Middle stages get at least one
    layer; the first and last stage may get none (then they run only the embedding / the head), which is
    what a large vocabulary can call for. Exact: a dynamic program over (stage, layers used), O(S * N^2).

    Among the splits whose slowest stage is within ``rtol`` of the optimum, the one closest to the uniform
    split is returned: measurements are noisy, and layers should not move for a difference below the noise.
    """
    num_layers = _check_costs(costs, num_stages)
    prefix = [0.0]
    for c in costs[1:-1]:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> float:  # stage runs layers [i, j)
        extra = (costs[0] if stage == 0 else 0.0) + (costs[-1] if stage == num_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    def min_layers(stage: int) -> int:
        end = stage in (0, num_stages - 1)
        return 0 if end and allow_empty_ends and num_stages > 1 else 1

    # Pass 1: the optimal bottleneck. best[j] = slowest stage of the best split of layers [0, j) so far.
    inf = float("inf")
    best = [cost(0, 0, j) if j >= min_layers(0) else inf for j in range(num_layers + 1)]
    for stage in range(1, num_stages):
        lo = min_layers(stage)
        best = [min((max(best[i], cost(stage, i, j)) for i in range(j - lo + 1) if best[i] < inf), default=inf)
                for j in range(num_layers + 1)]
    optimum = best[num_layers]
    # Pass 2: within the tolerance, the split closest (L1) to uniform. The small absolute slack keeps an
    # exact tie exact despite float sums taken in a different order.
    limit = optimum * (1.0 + rtol) + 1e-12 * max(1.0, abs(optimum))
    target = uniform_layers(num_layers, num_stages)
    dist_ = [abs(j - target[0]) if j >= min_layers(0) and cost(0, 0, j) <= limit else inf
             for j in range(num_layers + 1)]
    choice: list[list[int]] = [[0] * (num_layers + 1)]
    for stage in range(1, num_stages):
        lo, new, pick = min_layers(stage), [inf] * (num_layers + 1), [0] * (num_layers + 1)
        for j in range(num_layers + 1):
            for i in range(j - lo + 1):  # ascending i and strict `<`: deterministic tie-breaking
                if dist_[i] < inf and cost(stage, i, j) <= limit:
                    d = dist_[i] + abs(j - i - target[stage])
                    if d < new[j]:
                        new[j], pick[j] = d, i
        dist_ = new
        choice.append(pick)
    counts, j = [], num_layers
    for stage in range(num_stages - 1, 0, -1):
        i = choice[stage][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    counts.reverse()
    check_layer_counts(counts, num_layers, num_stages)
    return BalancePlan(counts, stage_times(costs, counts))


# -------------------------------------------------------------------------------------------- profiling
@dataclass(frozen=True)
class UnitCost:
    """What one unit costs on this rank for the profiled sample."""

    name: str  # "embed", "layer.3", "head"
    seconds: float  # median forward+backward time
    param_bytes: int
    activation_bytes: int  # tensors saved for backward (parameters excluded)


def _sync(device: torch.device) -> None:
    if device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out
    return next(v for v in values if isinstance(v, torch.Tensor))


def _detach(value, needs_grad: bool):
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
        return value.requires_grad_(needs_grad and value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_detach(v, False) for v in value)
    return value


def _capture_inputs(model: nn.Module, fqns: list[str], batch: dict) -> tuple[dict, torch.Tensor]:
    """One no-grad forward of ``model``: the (args, kwargs) each module in ``fqns`` was called with, and the logits."""
    inputs: dict[str, tuple[tuple, dict]] = {}

    def hook(name):  # a module called twice keeps its first call
        return lambda module, args, kwargs: inputs.setdefault(name, (args, kwargs)) and None

    handles = [model.get_submodule(f).register_forward_pre_hook(hook(f), with_kwargs=True) for f in fqns]
    try:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                           use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return inputs, logits


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses (DTensor) without a plain storage
        return None


def _saved_bytes(run, param_ptrs: set[int]) -> int:
    """Bytes of the tensors autograd saves for backward while ``run`` executes, parameters left out."""
    seen = set(param_ptrs)
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        storage = _storage(t)
        if storage is not None and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def _time_rounds(fns: list, device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Median time of each function, measured in rounds (every function once per round).

    Interleaving spreads a slow spell of the machine (another process, a frequency change) over every
    function alike instead of charging it to whichever one was being measured; the ratios are what matter.
    """
    times: list[list[float]] = [[] for _ in fns]
    for k in range(warmup + repeats):
        for fn, row in zip(fns, times):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if k >= warmup:
                row.append(time.perf_counter() - t0)
    return [statistics.median(row) for row in times]


def _module_runner(module: nn.Module, args: tuple, kwargs: dict, param_ptrs: set[int]):
    """fwd+bwd of ``module`` on fresh copies of its captured inputs; returns (run, measure_activation)."""
    args0, kwargs0 = args, kwargs

    def forward():
        # The activation flowing between units is the first positional input (or hidden_states).
        a = tuple(_detach(v, i == 0) for i, v in enumerate(args0))
        k = {n: _detach(v, n == "hidden_states" and not args0) for n, v in kwargs0.items()}
        return _first_tensor(module(*a, **k))

    def run():
        out = forward()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        return out.detach()

    return run, lambda: _saved_bytes(forward, param_ptrs)


def _loss_runner(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor):
    vocab = text_config(model).vocab_size

    def run():
        x = logits.detach().requires_grad_(True)
        model.loss_function(x, labels, vocab).backward()

    return run


def unit_modules(model: nn.Module, parts: ModelParts) -> list[tuple[str, list[str]]]:
    """Units in execution order: ("embed", pre modules), ("layer.i", [layer i]), ("head", post modules)."""
    layers = [(f"layer.{i}", [f"{parts.layers_fqn}.{i}"]) for i in range(parts.num_layers)]
    return [("embed", list(parts.pre)), *layers, ("head", list(parts.post))]


def profile_layers(model: nn.Module, sample_batch: dict, *, parts: ModelParts | None = None, repeats: int = 5,
                   warmup: int = 1) -> list[UnitCost]:
    """Forward+backward time (median of ``repeats``) and memory of every unit of ``model`` on this rank.

    One forward captures the input of every module; each module then runs alone on a fresh copy of its
    input, forward and backward (weight gradients included), and the head unit adds the model's own loss.
    Gradients the model held before are put back, so profiling leaves no trace on training.
    """
    parts = parts or model_parts(model)
    units = unit_modules(model, parts)
    device = next(model.parameters()).device
    if device.type == "meta":
        raise ValueError("pp_balance='profile' measures the model, but its weights are on the meta device; "
                         "materialize them first, or pass pp_balance as a list of layers per stage")
    batch = {k: v.to(device) for k, v in sample_batch.items()}
    inputs, logits = _capture_inputs(model, [f for _, names in units for f in names], batch)
    params = {id(p): p for p in model.parameters()}
    saved_grads = {k: p.grad for k, p in params.items()}
    param_ptrs = {st.data_ptr() for st in map(_storage, params.values()) if st is not None}
    runs, owner, results = [], [], []  # one fwd+bwd runner per module (+ the loss), owner = unit index
    try:
        for index, (name, names) in enumerate(units):
            act, pbytes, seen = 0, 0, set()
            for fqn in names:
                module = model.get_submodule(fqn)
                run, activation = _module_runner(module, *inputs[fqn], param_ptrs)
                runs.append(run)
                owner.append(index)
                act += activation()
                for p in module.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        pbytes += p.numel() * p.element_size()
            if name == "head":
                runs.append(_loss_runner(model, logits, batch["labels"]))
                owner.append(index)
            results.append((name, pbytes, act))
        seconds = [0.0] * len(units)
        for index, t in zip(owner, _time_rounds(runs, device, repeats, warmup)):
            seconds[index] += t
    finally:
        for k, p in params.items():
            p.grad = saved_grads[k]
    return [UnitCost(name, t, pbytes, act) for (name, pbytes, act), t in zip(results, seconds)]


def sample_batch(model: nn.Module, shape: tuple[int, int] | None = None, seed: int = 0) -> dict:
    """Deterministic random tokens (identical on every rank) of ``shape`` = (batch, sequence)."""
    cfg = text_config(model)
    if shape is None:
        shape = (1, min(getattr(cfg, "max_position_embeddings", DEFAULT_PROFILE_SEQ), DEFAULT_PROFILE_SEQ))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, tuple(shape), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


# ------------------------------------------------------------------------------------------- agreement
def agree_costs(costs: list[float], group=None, reduce: str = "median") -> list[float]:
    """The same per-unit costs on every rank of ``group``: every rank's measurements, reduced identically.

    Each rank gathers the full table and applies the same reduction to it, so the result is bitwise equal
    everywhere (an all-reduced mean need not be). The median ignores one rank slowed by a noisy neighbour.
    """
    local = torch.tensor(costs, dtype=torch.float64)
    table = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, local, group=group)
    reducers = {"median": lambda t: t.median(dim=0).values,  # the lower median for an even count
                "max": lambda t: t.max(dim=0).values, "mean": lambda t: t.mean(dim=0)}
    if reduce not in reducers:
        raise ValueError(f"reduce={reduce!r}; use 'median', 'max' or 'mean'")
    return reducers[reduce](torch.stack(table)).tolist()  # table: [ranks, units]


def check_same_split(counts: list[int], group=None) -> None:
    """Refuse to build stages if two ranks chose different splits (stages would not fit together)."""
    mine = torch.tensor(counts, dtype=torch.int64)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    if any(not torch.equal(t, mine) for t in table):
        raise RuntimeError(f"ranks disagree on the pipeline split: {[t.tolist() for t in table]}")


def _ms(values: list[float]) -> str:
    return "[" + ", ".join(f"{1e3 * v:.2f}" for v in values) + "]"


def _profile_in_turns(model, batch, parts, group, repeats: int) -> list[UnitCost]:
    """Ranks profile one after the other: ranks sharing one host's cores would otherwise slow each other."""
    units = None
    for turn in range(dist.get_world_size(group)):
        dist.barrier(group=group)
        if dist.get_rank(group) == turn:
            units = profile_layers(model, batch, parts=parts, repeats=repeats)
    dist.barrier(group=group)
    return units


def profile_plan(model: nn.Module, num_stages: int, group=None, sample_shape: tuple[int, int] | None = None,
                 repeats: int = 5, take_turns: bool | None = None,
                 allow_empty_ends: bool = True) -> tuple[BalancePlan, list[UnitCost]]:
    """Profile on every rank of ``group``, agree on the costs, split; every rank returns the same plan.

    ``take_turns`` (default: on CPU) makes the ranks profile one at a time; accelerators profile together.
    ``allow_empty_ends=False`` keeps at least one layer on the first and last stage (for a backend that
    cannot run a stage of only the embedding or only the head).
    """
    parts = model_parts(model)
    batch = sample_batch(model, sample_shape)
    if take_turns is None:
        take_turns = next(model.parameters()).device.type == "cpu"
    if take_turns and dist.is_initialized():
        units = _profile_in_turns(model, batch, parts, group, repeats)
    else:
        units = profile_layers(model, batch, parts=parts, repeats=repeats)
    seconds = agree_costs([u.seconds for u in units], group)
    # 2 %: below the run-to-run noise of a profile, moving a layer is as likely to hurt as to help.
    plan = partition(seconds, num_stages, rtol=0.02, allow_empty_ends=allow_empty_ends)
    check_same_split(plan.counts, group)
    uniform = stage_times(seconds, uniform_layers(parts.num_layers, num_stages))
    logger.info("pp_balance=profile: layers per stage %s, predicted fwd+bwd ms per stage %s (max/mean %.2f); "
                "uniform %s would be %s (max/mean %.2f)", plan.counts, _ms(plan.stage_seconds),
                plan.imbalance, uniform_layers(parts.num_layers, num_stages), _ms(uniform),
                max(uniform) / (sum(uniform) / len(uniform)))
    return plan, units


def profile_balance(model: nn.Module, mesh, config, sample_shape: tuple[int, int] | None = None,
                    allow_empty_ends: bool = True) -> list[int]:
    """Layers per stage for ``pp_balance="profile"``: the same list on every rank of ``mesh``.

    The costs are agreed over *every* rank of the mesh, not only the pp group: each dp/tp/cp replica of a
    stage must hold the same layers. The mesh spans the world, so that is the world group.
    """
    if mesh.world.size() != dist.get_world_size():
        raise RuntimeError(f"the mesh holds {mesh.world.size()} of {dist.get_world_size()} ranks; pp_balance="
                           "'profile' agrees over every rank, so the mesh must span the world")
    shape = sample_shape or getattr(config, "pp_profile_shape", None)
    plan, _ = profile_plan(model, config.pp_size * config.pp_virtual_stages, dist.group.WORLD, shape,
                           allow_empty_ends=allow_empty_ends)
    return plan.counts


# --------------------------------------------------------------------------------------- measured side
def measure_stage_seconds(pipe, batch: dict, group, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Forward+backward time of every stage of a built ``PipelineModel`` on ``batch`` (one micro-batch).

    The pp ranks take turns (a barrier over the world between turns), so no two stages compete for the
    same cores: on a shared CPU these are the times each stage would take on a device of its own. Turns
    go round ``warmup + repeats`` times, so a slow spell of the machine hits every stage alike. Returns the
    median time of each of the ``pipe.num_stages`` stages, on every rank of the pp ``group``; leaves the
    stages' gradients at None.
    """
    device = pipe.device
    cfg = text_config(pipe.config)
    ids = batch["input_ids"].to(device)
    labels = batch["labels"].to(device)
    runs = {}
    for stage, spec in zip(pipe.stages, pipe.specs):
        hidden = torch.randn(*ids.shape, cfg.hidden_size, device=device, dtype=next(stage.parameters()).dtype)

        def run(stage=stage, spec=spec, hidden=hidden):
            x = ids if spec.index == 0 else hidden.detach().requires_grad_(True)
            out = stage(x)
            if spec.index == pipe.num_stages - 1:
                pipe.loss.loss_function(out, labels, cfg.vocab_size).backward()
            else:
                out.backward(torch.ones_like(out))

        runs[spec.index] = run
    times: dict[int, list[float]] = {i: [] for i in runs}
    for k in range(warmup + repeats):
        for turn in range(dist.get_world_size(group)):
            dist.barrier()  # the world: ranks of other pp groups holding the same stage run together
            if dist.get_rank(group) != turn:
                continue
            for index, run in runs.items():
                t = _time_rounds([run], device, 1, 0)[0]
                if k >= warmup:
                    times[index].append(t)
    for p in pipe.parameters():
        p.grad = None
    mine = {i: statistics.median(ts) for i, ts in times.items()}
    table: list[dict[int, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(table, mine, group=group)
    merged = {k: v for part in table for k, v in part.items()}
    return [merged[i] for i in range(pipe.num_stages)]
