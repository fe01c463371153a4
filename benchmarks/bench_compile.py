"""Step time with ``compile=True`` (each decoder layer compiled) vs eager, on one process, FSDP2 and TP2.

For each layout one launch prepares the same Llama-shaped model twice (default hidden 256, 4 layers, seq 512,
batch 2 per data-parallel rank, fp32): once eager and once with ``ParallelismConfig(compile=True)`` and the given
backend (default inductor: on CPU its C++ backend). The two alternate step by step inside the launch, so machine
noise hits them alike. The first ``--warmup`` steps of each (where dynamo traces and inductor builds its kernels)
are left out of the median and reported on their own as "first step".

- **step**: forward + backward + AdamW step, median over the timed steps, slowest rank.
- **compiled / eager**: the ratio of those medians (< 1: compile is faster).

    python benchmarks/bench_compile.py                                  # one, fsdp2, tp2 with inductor
    python benchmarks/bench_compile.py --layouts one --backend aot_eager
    python benchmarks/bench_compile.py --quick                          # smoke run (hidden 64, seq 64)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch

LAYOUTS = {"one": (1, {}), "fsdp2": (2, dict(dp_shard_size=2)), "tp2": (2, dict(tp_size=2))}
VARIANTS = ("eager", "compiled")


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.testing.models import make_samples
    from nd_parallel.testing.parity import _collate

    _common.quiet_transformers()
    layout = json.loads(args.layout)
    seq = int(args.seq)
    samples = make_samples(n=2 * args.batch, seq_len=seq, min_len=seq)
    runs = {}
    for variant in VARIANTS:
        AcceleratorState._reset_state(reset_partial_state=False)
        accelerator = Accelerator()
        extra = dict(compile=True, compile_backend=args.backend) if variant == "compiled" else {}
        chunk = args.loss_chunk if args.loss_chunk == "auto" else int(args.loss_chunk)
        plugin = NDParallelPlugin(ParallelismConfig(**layout, **extra, loss_chunk_size=chunk)).attach(accelerator)
        model = plugin.from_pretrained(args.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = DataLoader(samples, batch_size=args.batch, collate_fn=_collate)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        runs[variant] = (accelerator, model, opt, next(iter(loader)))
    times = {v: [] for v in VARIANTS}
    for _ in range(int(args.warmup) + args.steps):
        for variant, (accelerator, model, opt, batch) in runs.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            out = model(**batch)
            accelerator.backward(out.loss)
            opt.step()
            opt.zero_grad(set_to_none=False)
            out.loss.item()
            times[variant].append(time.perf_counter() - start)
    warm = int(args.warmup)
    mine = {v: {"first": sum(t[:warm]), "step": statistics.median(t[warm:])} for v, t in times.items()}
    every = _common.gather(mine)
    _common.write_result(args, {v: {k: max(r[v][k] for r in every) for k in ("first", "step")} for v in VARIANTS})


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, seq=512, batch=2, vocab=8192, hidden=256, layers=4, steps=5, warmup=2, backend="inductor",
                  layouts=",".join(LAYOUTS),
                  loss_chunk=("auto", "loss_chunk_size of both variants: auto, or tokens per chunk, 0 = HF's loss [auto]"))
    return _common.parse(p, argv, quick={"seq": 64, "hidden": 64, "layers": 2, "vocab": 512, "steps": 2},
                         internal=("--layout", "--model"))


HEAD = ["layout", "eager step (ms)", "compiled step (ms)", "compiled / eager", "eager first steps (s)",
        "compiled first steps (s)"]


def parent(args, argv) -> None:
    rows, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = _common.save_llama(Path(tmp) / "m", args.hidden, args.layers, heads=4, vocab_size=args.vocab,
                                   max_position_embeddings=max(args.seq, 128))
        for name in args.layouts.split(","):
            world, layout = LAYOUTS[name]
            print(f"-- {name} ({world} rank(s))", file=sys.stderr, flush=True)
            res, took = _common.launch_timed(__file__, world, [
                f"--seq={args.seq}", f"--batch={args.batch}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                f"--backend={args.backend}", f"--loss-chunk={args.loss_chunk}", f"--layout={json.dumps(layout)}",
                f"--model={model}"], timeout=3600)
            print(f"   launch took {took}: {json.dumps(res)}", file=sys.stderr, flush=True)
            e, c = res["eager"], res["compiled"]
            rows.append([name, f"{1e3 * e['step']:.0f}", f"{1e3 * c['step']:.0f}", f"{c['step'] / e['step']:.2f}x",
                         f"{e['first']:.1f}", f"{c['first']:.1f}"])
            raw.append((name, res))
    print(f"\nllama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}, batch {args.batch} "
          f"per dp rank, fp32, backend {args.backend}, torch {torch.__version__}, {args.steps} timed steps after "
          f"{args.warmup} warm-up; load {_common.loadavg()}\n")
    print("\n".join(_common.md_table(HEAD, rows)))
    print("\nraw:", json.dumps(raw))


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
