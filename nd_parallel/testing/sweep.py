"""The model sweep: every causal-LM model type of the installed transformers under FSDP2, TP2, PP2, CP2 and EP2.

One launch of 2 ranks runs many types (start-up is most of a launch's cost). Per type, rank 0 builds a tiny model
(``tiny_configs``), saves it, and trains it in one process on the global batch; then every layout trains it on both
ranks through the unchanged Accelerate loop (``parity.train_layout``). Each cell ends as one of:

- ``match``: loss and grad norm every step within rtol 1e-5, every parameter within atol 1e-5, the same loss on
  every rank;
- ``refused``: our own ``ValueError``/``NotImplementedError``, raised inside nd_parallel with the same message on
  every rank, and before any collective (the sum of every process group's sequence number did not move);
- ``differs`` / ``crash``: anything else, which the tests fail on.

A type whose tiny config cannot be built, or whose one-process run fails, gets a ``status`` with the reason and no
cells (``default fails`` where transformers cannot build the type's own default config either). Used by ``tests/distributed/test_model_sweep.py`` (a subset) and ``benchmarks/sweep_models.py`` (all types).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .models import make_samples
from .parity import Recipe, compare, train_reference

LOSS_RTOL = NORM_RTOL = 1e-5
PARAM_ATOL = 1e-5  # fp32 with AdamW eps 1e-6: see parity.Recipe.adam_eps
SEQ_LEN = 16  # 2 * cp divides it: the load-balanced ring needs no padding, the ulysses path is not taken
GLOBAL_BATCH = 2  # samples per step in every layout: dp layouts take 1 per rank, the others 2
STEPS = 3
# layout name -> (ParallelismConfig kwargs, data-parallel size); ep2 only where the model has experts.
LAYOUTS = {
    "fsdp2": (dict(dp_shard_size=2), 2),
    "tp2": (dict(tp_size=2), 1),
    "pp2": (dict(pp_size=2, pp_microbatches=2), 1),
    "cp2": (dict(cp_size=2), 1),
    "ep2": (dict(dp_shard_size=2, ep_size=2), 2),
}


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal LM, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _collectives() -> int:
    """Collectives issued so far on this rank, over every process group (each bumps its group's sequence number)."""
    from torch.distributed import distributed_c10d as c10d

    return sum(pg._get_sequence_number_for_group() for pg in list(c10d._world.pg_map))


def _ours(err: BaseException) -> bool:
    """Raised by nd_parallel itself (its last frame is in the library), as a refusal type."""
    frames = traceback.extract_tb(err.__traceback__)
    return isinstance(err, (ValueError, NotImplementedError)) and bool(frames) and (
        "/nd_parallel/" in frames[-1].filename and "/nd_parallel/testing/" not in frames[-1].filename)


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:400]


def _build(model_type: str, directory: Path) -> tuple[str, str]:
    """Rank 0: save the tiny model of ``model_type`` in ``directory``; ("ok", "") or (status, reason)."""
    from transformers import AutoModelForCausalLM

    from .tiny_configs import tiny_sweep_config

    try:
        config = tiny_sweep_config(model_type)
    except Exception as err:  # noqa: BLE001 - listed with its reason, not hidden
        return "no tiny config", _reason(err)
    try:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    except Exception as err:  # noqa: BLE001
        return _default_fails(model_type) or "model fails", _reason(err)
    return "ok", ""


def _default_fails(model_type: str) -> str | None:
    """"default fails" where transformers cannot build the type's own default config either (on the meta device):
    a defect of that type in transformers, not of the tiny builder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception:  # noqa: BLE001
        return "default fails"
    return None


def _reference(directory: Path, samples, recipe: Recipe):
    try:
        ref = train_reference(directory, samples, 1, Recipe(**{**recipe.__dict__, "per_rank_batch": GLOBAL_BATCH}))
    except Exception as err:  # noqa: BLE001
        return None, ("one process fails", _reason(err))
    if not all(torch.isfinite(torch.tensor(ref.losses + ref.norms))):
        return None, ("one process fails", f"non-finite loss or grad norm: {ref.losses} {ref.norms}")
    return ref, ("ok", "")


def _run_cell(directory: Path, samples, recipe: Recipe, layout: dict, dp: int):
    """Train under ``layout`` on this rank; (result or None, error or None, collectives issued before an error)."""
    from accelerate import Accelerator

    from nd_parallel.accelerate import NDParallelPlugin
    from nd_parallel.config import ParallelismConfig

    from .parity import train_layout

    before = _collectives()
    try:
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        per_rank = Recipe(**{**recipe.__dict__, "per_rank_batch": GLOBAL_BATCH // dp})
        result = train_layout(accelerator, plugin, directory, samples, per_rank)
        result.optimizer = result.model = None
        return result, None, 0
    except Exception as err:  # noqa: BLE001 - classified below, on every rank together
        return None, err, _collectives() - before


def _classify(ref, result, err, issued) -> dict:
    """This rank's view of one cell, sent to rank 0."""
    if err is not None:
        return {"error": _reason(err), "ours": _ours(err), "issued": issued,
                "where": "".join(traceback.format_exception(err)[-3:])[-600:]}
    return {"losses": result.losses, "norms": result.norms}


def _verdict(views: list[dict], ref, state) -> dict:
    """Rank 0: one cell's outcome from every rank's view and its own parameters."""
    errors = [v for v in views if "error" in v]
    if errors:
        same = len(errors) == len(views) and len({v["error"] for v in errors}) == 1
        if same and all(v["ours"] and v["issued"] == 0 for v in errors):
            return {"outcome": "refused", "reason": errors[0]["error"]}
        return {"outcome": "crash", "reason": errors[0]["error"], "where": errors[0]["where"],
                "issued": [v.get("issued") for v in views]}
    from .parity import RunResult

    diff = compare(ref, RunResult(views[0]["losses"], views[0]["norms"], state))
    spread = max(abs(a - b) for v in views for a, b in zip(v["losses"], views[0]["losses"]))
    ok = (diff["loss_rel"] <= LOSS_RTOL and diff["norm_rel"] <= NORM_RTOL and diff["param_abs"] <= PARAM_ATOL
          and spread == 0.0)
    return {"outcome": "match" if ok else "differs", **diff, "rank_spread": spread}


def sweep_type(model_type: str, work: Path, recipe: Recipe, layouts=None) -> dict:
    """Every rank: build (rank 0), reference (rank 0), then every layout that applies; rank 0's record."""
    from nd_parallel.models.moe import num_experts

    rank = dist.get_rank()
    start = time.perf_counter()
    directory = work / model_type
    status = [_build(model_type, directory) if rank == 0 else None]
    samples = make_samples(GLOBAL_BATCH * recipe.steps, SEQ_LEN, seed=1)
    ref = None
    if rank == 0 and status[0][0] == "ok":
        ref, status[0] = _reference(directory, samples, recipe)
    dist.broadcast_object_list(status, src=0)
    record = {"type": model_type, "status": status[0][0], "reason": status[0][1], "cells": {},
              "reference_seconds": round(time.perf_counter() - start, 2)}
    if status[0][0] != "ok":
        return record
    from transformers import AutoConfig

    moe = num_experts(AutoConfig.from_pretrained(directory)) is not None
    for name, (layout, dp) in (layouts or LAYOUTS).items():
        if name == "ep2" and not moe:
            continue
        start = time.perf_counter()
        if rank == 0:  # what a launch that dies or hangs was doing (sweep_launch puts it in the record)
            (work.parent / "current_cell.txt").write_text(f"{model_type} {name}")
        result, err, issued = _run_cell(directory, samples, recipe, layout, dp)
        seconds = time.perf_counter() - start
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, _classify(ref, result, err, issued))
        if rank == 0:
            record["cells"][name] = {**_verdict(views, ref, result.state if result else None),
                                     "seconds": round(seconds, 2)}
        del result, err
        gc.collect()
    return record


def _type_watchdog(model_type: str, seconds: float) -> threading.Timer:
    """Ends this rank if ``model_type`` has not finished within ``seconds``: a hang (ranks waiting on each other
    outside any timed collective) then costs one type's limit, not the whole launch's timeout, and the launcher
    records the type as ``launch died`` during the cell in ``current_cell.txt`` and goes on with the next types."""
    def die():
        print(f"[sweep] {model_type} did not finish within {seconds:.0f}s: ending the launch", flush=True)
        os._exit(3)
    timer = threading.Timer(seconds, die)
    timer.daemon = True
    timer.start()
    return timer


def run_sweep(types: list[str], out: Path, steps: int = STEPS, layouts=None, type_timeout: float = 600) -> None:
    """The rank program: every type in turn; rank 0 appends one JSON line per type to ``out`` as it finishes."""
    recipe = Recipe(steps=steps, lr=1e-3)
    work = out.parent / "models"
    for model_type in types:
        watchdog = _type_watchdog(model_type, type_timeout)
        record = sweep_type(model_type, work, recipe, layouts)
        watchdog.cancel()
        if dist.get_rank() == 0:
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
        dist.barrier()


if __name__ == "__main__":  # the rank program: python -m nd_parallel.testing.sweep OUT_DIR SPEC_JSON
    spec = json.load(open(sys.argv[2]))  # {"types": [...], "steps": n}
    # A cell that crashed on one rank leaves the other in a collective: time it out, so the launcher sees it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.get("collective_timeout", 300)))
    run_sweep(spec["types"], Path(sys.argv[1]) / "sweep.jsonl", steps=spec.get("steps", STEPS),
              type_timeout=spec.get("type_timeout", 600))
    dist.destroy_process_group()
