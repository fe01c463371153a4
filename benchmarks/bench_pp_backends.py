"""Step time of the two pipeline backends on the same model, p and m, in one launch: torch 1F1B vs DeepSpeed.

Both backends are prepared side by side in every rank (same checkpoint, same batches, same recipe: AdamW,
clipping at 1.0) and alternate step by step, so load from other work on the machine hits them alike. The
first steps (shape inference, DeepSpeed's buffer set-up) are discarded. The script prints each backend's
median step time, the ratio torch/deepspeed, and checks that both report the same first-step loss.

    python benchmarks/bench_pp_backends.py                 # pp=2, m=4, hidden 256, 4 layers, seq 128
    python benchmarks/bench_pp_backends.py --quick         # smoke run
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.testing.models import make_samples
    from nd_parallel.testing.parity import _collate

    samples = make_samples(args.per_rank_batch * (args.steps + 2), args.seq, min_len=args.seq)
    runs = {}
    for backend in ("torch", "deepspeed"):
        accelerator = Accelerator()
        config = ParallelismConfig(pp_size=args.pp, pp_microbatches=args.microbatches, pp_backend=backend)
        plugin = NDParallelPlugin(config).attach(accelerator)
        model = plugin.from_pretrained(args.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = DataLoader(samples, batch_size=args.per_rank_batch, collate_fn=_collate)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        runs[backend] = (accelerator, model, opt, list(loader))
    times = {b: [] for b in runs}
    first_loss = {}
    for step in range(args.steps):
        for backend, (accelerator, model, opt, batches) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            out = model(**batches[step])
            accelerator.backward(out.loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            times[backend].append(elapsed.item())
            first_loss.setdefault(backend, out.loss.item())
    _common.write_result(args, {"times": times, "first_loss": first_loss})


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, pp=2, microbatches=4, per_rank_batch=8, seq=128, hidden=256, layers=4, steps=12, warmup=2)
    return _common.parse(p, argv, quick={"hidden": 64, "layers": 4, "seq": 32, "steps": 5, "per_rank_batch": 4},
                         internal=("--model",))


def parent(args, argv) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = _common.save_llama(Path(tmp) / "model", args.hidden, args.layers, heads=8)
        forwarded = [f"--pp={args.pp}", f"--microbatches={args.microbatches}",
                     f"--per-rank-batch={args.per_rank_batch}", f"--seq={args.seq}", f"--steps={args.steps}",
                     f"--model={model}"]
        data = _common.launch_self(__file__, args.pp, forwarded, timeout=1200, env={"DS_ACCELERATOR": "cpu"},
                                   capture=True)
    med = {b: statistics.median(t[args.warmup:]) for b, t in data["times"].items()}
    print(f"pp={args.pp} microbatches={args.microbatches} per-rank batch={args.per_rank_batch} seq={args.seq} "
          f"hidden={args.hidden} layers={args.layers}; {args.steps - args.warmup} timed steps each, alternating")
    print(f"{'backend':<10} {'median step (ms)':>17} {'first-step loss':>16}")
    for backend in med:
        print(f"{backend:<10} {med[backend] * 1e3:>17.1f} {data['first_loss'][backend]:>16.6f}")
    print(f"ratio torch/deepspeed: {med['torch'] / med['deepspeed']:.3f}")


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
