"""`nd-parallel demo`: a tiny seeded model trained under a layout, then in one process on the same global batches;
the table shows how far apart the two runs ended (losses, parameters, gradient norms) and each rank's memory."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from nd_parallel.config import ParallelismConfig

from .ranks import choose_ranks, parse_layout, run_job
from .report import checkpoint_numel, human_bytes, loss_lines, memory_lines, table, unsharded_bytes
from .train.job import DemoJob

TOLERANCE = 1e-5  # what the parity tests hold every layout to, quoted next to the demo's numbers


def _verdict(x: float) -> str:
    return f"{x:.2e}   {'ok' if x <= TOLERANCE else 'ABOVE'} (tolerance {TOLERANCE:g})"


def _spread(ranks: list[dict]) -> float:
    first = ranks[0]["losses"]
    return max(abs(a - b) for r in ranks for a, b in zip(r["losses"], first))


def _train_both(args, config: ParallelismConfig, nproc: int, device: str) -> dict | None:
    """The layout's results and its differences from one process (None on a rank that does not report)."""
    import torch

    from nd_parallel.testing.models import make_samples, save_tiny_model
    from nd_parallel.testing.parity import Recipe, RunResult, compare, train_reference

    recipe = Recipe(steps=args.steps, per_rank_batch=2, lr=1e-3)
    with tempfile.TemporaryDirectory(prefix="nd-parallel-demo-") as tmp:
        tmp = Path(tmp)
        model_dir = str(save_tiny_model(args.family, tmp / "model", seed=args.seed))
        samples = make_samples(args.steps * recipe.per_rank_batch * config.dp_size, args.seq_len, seed=args.seed)
        if device != "launched":  # the ranks read the samples from a file; an outer launcher's rank is this one
            torch.save(samples, tmp / "samples.pt")
        job = DemoJob(name=args.layout, layout=config, model_dir=model_dir, recipe=recipe, quiet=not args.verbose,
                      samples=samples if device == "launched" else str(tmp / "samples.pt"))
        start = time.perf_counter()
        results = run_job(job, nproc, device, tmp, args.timeout)
        if results is None:
            return None
        trained = time.perf_counter() - start
        torch.set_num_threads(1)  # a tiny model: more threads only add overhead (10x on a busy 2-core machine)
        ref = train_reference(model_dir, samples, config.dp_size, recipe)
        diff = compare(ref, RunResult(results["losses"], results["norms"], results["state"]))
        referenced = time.perf_counter() - start - trained
        return {"results": results, "diff": diff, "trained": trained, "referenced": referenced,
                "n_params": checkpoint_numel(model_dir)}


def cmd_demo(args) -> int:
    config, nproc, device = choose_ranks(ParallelismConfig(**parse_layout(args.layout)), args.nproc, args.cpu,
                                         cpu_fallback=True)
    run = _train_both(args, config, nproc, device)
    if run is None:
        return 0
    results, diff, n_params = run["results"], run["diff"], run["n_params"]
    unsharded = unsharded_bytes(n_params)
    where = results["ranks"][0]["device"].split(":")[0]
    rows = [
        ("layout", f"{args.layout}: {results['layout']}, {nproc} {where.upper()} ranks"),
        (f"loss per step ({args.steps})", loss_lines(results["losses"])),
        ("max loss rel diff", _verdict(diff["loss_rel"])),
        ("max param abs diff", _verdict(diff["param_abs"])),
        ("max grad-norm rel diff", _verdict(diff["norm_rel"])),
        ("loss spread over ranks", f"{_spread(results['ranks']):.1e} (the same number on every rank)"),
        ("params + AdamW per rank", memory_lines(results["ranks"], unsharded)),
        ("unsharded (1 process)",
         f"{human_bytes(unsharded)} = {n_params:,} params x 3 (param + 2 AdamW moments), fp32"),
        ("time", f"{run['trained']:.1f} s launch + train, {run['referenced']:.1f} s single-process reference"),
    ]
    print(table(f"nd-parallel demo: tiny {args.family}, {args.steps} AdamW steps vs one process "
                "on the same global batches", rows))
    worst = max(diff.values())
    return 0 if worst <= TOLERANCE else 1
