"""The collectives of balancing: every rank measures, all take the same costs, all build the same split.

Separate from the single-rank measuring and the pure partition because these functions need a process
group: each one is called on every rank of ``group`` at the same point, or the job hangs.
"""

from __future__ import annotations

import logging
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

from nd_parallel.models.hf import model_parts, text_config

from ..split import uniform_layers
from .measure import UnitCost, profile_layers, sample_batch, time_rounds
from .partition import BalancePlan, partition, stage_times

logger = logging.getLogger(__name__)


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


def _stage_runners(pipe, batch: dict) -> dict:
    """Per stage this rank holds: one fwd+bwd on ``batch`` (a random activation stands in for the input)."""
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
    return runs


def measure_stage_seconds(pipe, batch: dict, group, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Forward+backward time of every stage of a built ``PipelineModel`` on ``batch`` (one micro-batch).

    The pp ranks take turns (a barrier over the world between turns), so no two stages compete for the
    same cores: on a shared CPU these are the times each stage would take on a device of its own. Turns
    go round ``warmup + repeats`` times, so a slow spell of the machine hits every stage alike. Returns the
    median time of each of the ``pipe.num_stages`` stages, on every rank of the pp ``group``; leaves the
    stages' gradients at None.
    """
    runs = _stage_runners(pipe, batch)
    # The last stage hands over logits, not the hidden states of a chunked loss (torch_backend.PipelineLoss): the
    # runner calls HF's loss on them. The head's FLOPs are the same either way.
    chunking, pipe.loss.training = pipe.loss.training, False
    try:
        return _take_turns(runs, group, pipe, repeats, warmup)
    finally:
        pipe.loss.training = chunking


def _take_turns(runs: dict, group, pipe, repeats: int, warmup: int) -> list[float]:
    times: dict[int, list[float]] = {i: [] for i in runs}
    for k in range(warmup + repeats):
        for turn in range(dist.get_world_size(group)):
            dist.barrier()  # the world: ranks of other pp groups holding the same stage run together
            if dist.get_rank(group) != turn:
                continue
            for index, run in runs.items():
                t = time_rounds([run], pipe.device, 1, 0)[0]
                if k >= warmup:
                    times[index].append(t)
    for p in pipe.parameters():
        p.grad = None
    mine = {i: statistics.median(ts) for i, ts in times.items()}
    table: list[dict[int, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(table, mine, group=group)
    merged = {k: v for part in table for k, v in part.items()}
    return [merged[i] for i in range(pipe.num_stages)]
