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

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

WORLDS = (1, 2, 4)
MB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--reps", type=int, default=3, help="repetitions per world size [3]")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 repetitions")
    p.add_argument("--json", help="also write the raw results to this file")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.intermediate, args.reps = 64, 2, 128, 2
    return args


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
    from transformers.utils import logging as hf_logging

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.checkpoint import full_state
    from nd_parallel.testing.models import make_samples

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
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
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, rows)
    else:
        gathered = [rows]
    if accelerator.is_main_process:
        n_params = sum(p.numel() for p in model.parameters()) if world == 1 else None
        Path(args.result).write_text(json.dumps({"world": world, "ranks": gathered, "n_params": n_params}))
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


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from nd_parallel.testing.launch import launch_for_result
    from nd_parallel.testing.models import save_tiny_model

    results, meta = {}, {"load_start": _loadavg()}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        heads = max(1, args.hidden // 64)
        model_dir = save_tiny_model("llama", Path(tmp) / "model", hidden_size=args.hidden,
                                    num_hidden_layers=args.layers, intermediate_size=args.intermediate,
                                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                                    head_dim=args.hidden // heads, tie_word_embeddings=False)
        for world in WORLDS:
            print(f"[bench] {world} rank(s) ...", flush=True)
            results[world] = launch_for_result(str(Path(__file__).resolve()), world,
                                               [*argv, "--model-dir", str(model_dir), "--out-dir", tmp],
                                               timeout=args.timeout, env={"HF_HUB_OFFLINE": "1"})
    meta["load_end"] = _loadavg()
    meta["n_params"] = results[1]["n_params"]
    summaries = {w: summarize(r) for w, r in results.items()}
    print(report(summaries, args, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "meta": meta, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
