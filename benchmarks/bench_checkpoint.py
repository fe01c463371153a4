"""Save and load time and bytes written per rank: sharded checkpoints at 2 and 4 ranks vs one process.

Each world size runs in its own launch on the same checkpoint (Llama, untied, fp32; model + AdamW state after one
step), several repetitions each:

    one process   accelerator.save_state / load_state with nd_parallel in a single process: one process holds
                  and writes everything (the baseline)
    sharded       FSDP over 2 or 4 ranks: save_state writes one DCP file per rank with what that rank owns,
                  load_state reads back what it owns
    rank-0 file   the same ranks, but the full model + optimizer state gathered to rank 0 tensor by tensor
                  (nd_parallel.checkpoint.full_state) and written by rank 0 alone into one safetensors file: what
                  a non-sharded save costs under the same layout

Times are wall seconds between barriers (the slowest rank), median over the repetitions. "bytes/rank" is what
each rank wrote (its DCP file and RNG file; rank 0 also the metadata, marker and config). Loads read files the
save just wrote, so they come from the page cache: they measure the CPU side (deserialising, resharding,
copying), not the disk.

    python benchmarks/bench_checkpoint.py            # hidden 512, 8 layers, intermediate 1536: 25.4M params
    python benchmarks/bench_checkpoint.py --quick    # smoke run: a tiny model, 2 repetitions
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch
from _common import MB

WORLDS = (1, 2, 4)


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, hidden=512, layers=8, intermediate=1536, reps=(3, "repetitions per world size [3]"))
    return _common.parse(p, argv, quick={"hidden": 64, "layers": 2, "intermediate": 128, "reps": 2},
                         quick_help="smoke run: tiny model, 2 repetitions",
                         json_help="also write the raw results to this file", timeout=1800,
                         internal=("--model-dir", "--out-dir"))


def _files_by_rank(ckpt: Path, world: int) -> list[int]:
    """Bytes each rank wrote: its __<rank>_0.distcp and rng file; rank 0 also metadata, marker, configs."""
    sizes = [0] * world
    for path in ckpt.rglob("*"):
        if not path.is_file():
            continue
        name = path.name
        if name.endswith(".distcp"):
            rank = int(name[2:].split("_")[0])
        elif name.startswith("rank_") and name.endswith(".safetensors"):
            rank = int(name[5:10])
        else:
            rank = 0
        sizes[rank] += path.stat().st_size
    return sizes


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from safetensors.torch import save_file

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.checkpoint import full_state
    from nd_parallel.testing.models import make_samples

    _common.quiet_transformers()
    accelerator = Accelerator()
    world = accelerator.num_processes
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=world)).attach(accelerator)
    model = plugin.from_pretrained(args.model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = accelerator.prepare(model, opt)
    batch = {k: torch.stack([s[k] for s in make_samples(1, 32)]) for k in ("input_ids", "labels")}
    accelerator.backward(model(**batch).loss)  # one step, so that AdamW holds its two moments
    opt.step()
    opt.zero_grad()

    def sync():
        if world > 1:
            dist.barrier()

    def timed(fn):
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        sync()
        return time.perf_counter() - start, time.process_time() - cpu

    rows = []
    for rep in range(args.reps):
        ckpt = Path(args.out_dir) / f"w{world}_r{rep}"
        row = {"save": timed(lambda: accelerator.save_state(ckpt))}
        row["bytes"] = _files_by_rank(ckpt, world) if accelerator.is_main_process else None
        row["load"] = timed(lambda: accelerator.load_state(ckpt))
        if world > 1:
            single = ckpt / "rank0.safetensors"

            def rank0_file():
                state = full_state(accelerator, model, opt)
                if accelerator.is_main_process:
                    save_file({k: v.contiguous() for k, v in state.items()}, str(single))

            row["rank0"] = timed(rank0_file)
            row["rank0_bytes"] = single.stat().st_size if accelerator.is_main_process else None
        sync()
        if accelerator.is_main_process:
            shutil.rmtree(ckpt)
        rows.append(row)
    gathered = _common.gather(rows)
    n_params = sum(p.numel() for p in model.parameters()) if world == 1 else None
    _common.write_result(args, {"world": world, "ranks": gathered, "n_params": n_params})
    sync()


def _median(values):
    return statistics.median(values) if values else float("nan")


def summarize(result: dict) -> dict:
    rank0 = result["ranks"][0]
    out = {"world": result["world"], "save": _median([r["save"][0] for r in rank0]),
           "load": _median([r["load"][0] for r in rank0]),
           "save_cpu": _median([sum(rk[i]["save"][1] for rk in result["ranks"]) for i in range(len(rank0))]),
           "load_cpu": _median([sum(rk[i]["load"][1] for rk in result["ranks"]) for i in range(len(rank0))]),
           "bytes": rank0[0]["bytes"]}
    if "rank0" in rank0[0]:
        out["rank0"] = _median([r["rank0"][0] for r in rank0])
        out["rank0_bytes"] = rank0[0]["rank0_bytes"]
    return out


def report(summaries: dict, args, meta: dict) -> str:
    base = summaries[1]
    total = sum(base["bytes"])
    lines = [f"model: llama {meta['n_params'] / 1e6:.1f}M params fp32 (hidden {args.hidden}, {args.layers} layers, "
             f"intermediate {args.intermediate}); checkpoint = model + AdamW moments = {total / MB:.1f} MiB; "
             f"median of {args.reps} repetitions; load avg {meta['load_start']} -> {meta['load_end']}",
             "",
             f"{'layout':<14}{'save s':>8}{'load s':>8}{'save CPU s':>12}{'load CPU s':>12}{'max MiB/rank':>14}"
             f"{'bytes/rank vs 1':>17}{'save vs 1':>11}{'load vs 1':>11}"]
    for world, s in summaries.items():
        name = "one process" if world == 1 else f"sharded x{world}"
        biggest = max(s["bytes"])
        lines.append(f"{name:<14}{s['save']:>8.2f}{s['load']:>8.2f}{s['save_cpu']:>12.2f}{s['load_cpu']:>12.2f}"
                     f"{biggest / MB:>14.1f}{biggest / total:>17.2f}{s['save'] / base['save']:>11.2f}"
                     f"{s['load'] / base['load']:>11.2f}")
    lines.append("")
    lines.append("bytes per rank (sharded): " + "; ".join(
        f"x{w}: " + " ".join(f"{b / MB:.1f}" for b in s["bytes"]) + " MiB" for w, s in summaries.items() if w > 1))
    for world, s in summaries.items():
        if world > 1:
            lines.append(f"rank-0 file x{world}: gather + write {s['rank0']:.2f} s = {s['rank0'] / s['save']:.2f}x the "
                         f"sharded save; rank 0 writes {s['rank0_bytes'] / MB:.1f} MiB, the others nothing (sharded: "
                         f"largest file {max(s['bytes']) / s['rank0_bytes']:.2f}x that)")
    return "\n".join(lines)


def parent(args, argv) -> None:
    results, meta = {}, {"load_start": _common.loadavg()}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        model_dir = _common.save_llama(Path(tmp) / "model", args.hidden, args.layers, heads=max(1, args.hidden // 64),
                                       intermediate=args.intermediate)
        for world in WORLDS:
            print(f"[bench] {world} rank(s) ...", flush=True)
            results[world] = _common.launch_self(__file__, world, [*argv, "--model-dir", model_dir, "--out-dir", tmp],
                                                 timeout=args.timeout)
    meta["load_end"] = _common.loadavg()
    meta["n_params"] = results[1]["n_params"]
    summaries = {w: summarize(r) for w, r in results.items()}
    print(report(summaries, args, meta))
    _common.write_json(args.json, {"results": results, "meta": meta, "args": vars(args)})


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
