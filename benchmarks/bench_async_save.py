"""Training stall per checkpoint: synchronous save_state vs async_save (torch.distributed.checkpoint.async_save).

One launch of 2 ranks (FSDP2, Llama-shaped, fp32, AdamW), training continuously; every ``--every`` steps it saves,
alternating sync and async so machine noise hits both alike. Per save, the slowest rank's:

- **call**: seconds ``accelerator.save_state`` blocks the loop (sync: the whole write; async: copying the state to
  host memory, DCP's planning collectives and the RNG files);
- **slowdown**: extra seconds the following steps took while the background write ran, over the median step time
  of steps with no save in flight (on a machine with few cores the writer thread competes with training);
- **wait**: seconds the loop still had to wait for the write when the next save came (``--every`` steps later);
- **stall** = call + slowdown + wait: what the save cost the training loop.

    python benchmarks/bench_async_save.py            # hidden 512, 8 layers: 25.4M params, 3 saves per mode
    python benchmarks/bench_async_save.py --quick    # smoke run
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch
from _common import MB


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, hidden=512, layers=8, intermediate=1536, seq=128, saves=(3, "saves per mode [3]"),
                  every=(6, "optimizer steps between saves [6]"))
    return _common.parse(p, argv, quick={"hidden": 64, "layers": 2, "intermediate": 128, "saves": 2, "every": 3},
                         json_help="also write the raw results to this file", internal=("--model-dir", "--out-dir"))


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.checkpoint import asynchronous
    from nd_parallel.testing.models import make_samples

    accelerator = Accelerator()
    plugin = NDParallelPlugin(ParallelismConfig(dp_shard_size=2)).attach(accelerator)
    model = plugin.from_pretrained(args.model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    samples = make_samples(4 * args.every * (2 * args.saves + 2), args.seq)
    loader = DataLoader(samples, batch_size=2, collate_fn=lambda s: {k: torch.stack([x[k] for x in s]) for k in s[0]})
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def step(batch) -> float:
        start = time.perf_counter()
        out = model(**batch)
        accelerator.backward(out.loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    batches = iter(loader)
    quiet, saves = [], []
    for _ in range(3):  # warm-up, then the quiet baseline steps
        step(next(batches))
    for _ in range(args.every):
        quiet.append(step(next(batches)))
    for i in range(2 * args.saves):
        plugin.config.async_save = bool(i % 2)  # alternate: sync, async, sync, ...
        dist.barrier()
        start = time.perf_counter()
        accelerator.save_state(os.path.join(args.out_dir, f"ckpt_{i}"))
        call = time.perf_counter() - start
        during = []
        for _ in range(args.every):
            busy = bool(asynchronous._pending) and not asynchronous._pending[0][1].is_set()
            took = step(next(batches))
            (during if busy else quiet).append(took)
        start = time.perf_counter()
        asynchronous.wait_pending()
        wait = time.perf_counter() - start
        saves.append({"mode": "async" if i % 2 else "sync", "call": call, "during": during, "wait": wait})
    baseline = statistics.median(quiet)
    for s in saves:
        s["slowdown"] = max(0.0, sum(s["during"]) - baseline * len(s["during"]))
        s["stall"] = s["call"] + s["slowdown"] + s["wait"]
    gathered = _common.gather({"saves": saves, "baseline": baseline})
    size = sum(p.stat().st_size for p in Path(args.out_dir, "ckpt_0").rglob("*") if p.is_file())
    _common.write_result(args, {"ranks": gathered, "checkpoint_bytes": size,
                                "n_params": sum(p.numel() for p in model.parameters())})  # DTensor: global numel


def report(result: dict, args) -> str:
    ranks = result["ranks"]
    rows = []
    for mode in ("sync", "async"):
        per_save = [max(r["saves"][i][key] for r in ranks) for key in ("call", "slowdown", "wait", "stall")
                    for i in range(len(ranks[0]["saves"])) if ranks[0]["saves"][i]["mode"] == mode]
        n = len(per_save) // 4
        cols = [statistics.median(per_save[k * n:(k + 1) * n]) for k in range(4)]
        rows.append([mode, *(f"{c:.2f}" for c in cols)])
    baseline = max(r["baseline"] for r in ranks)
    return "\n".join([
        f"2 ranks FSDP2, hidden {args.hidden}, {args.layers} layers ({result['n_params'] / 1e6:.1f}M params, "
        f"checkpoint {result['checkpoint_bytes'] / MB:.0f} MiB), seq {args.seq}; step {baseline:.2f} s; "
        f"median of {args.saves} saves per mode, slowest rank, seconds",
        "", *_common.md_table(["mode", "call", "slowdown", "wait", "stall"], rows)])


def parent(args, argv) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_async_save_") as tmp:
        model_dir = _common.save_llama(Path(tmp) / "model", args.hidden, args.layers, heads=max(1, args.hidden // 64),
                                       intermediate=args.intermediate)
        result = _common.launch_self(__file__, 2, [*argv, "--model-dir", model_dir, "--out-dir", tmp], timeout=1800)
    print(report(result, args))
    _common.write_json(args.json, {"result": result, "args": vars(args)})


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
