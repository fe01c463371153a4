"""Step time of the two pipeline backends on the same model, p and m, in one launch: torch 1F1B vs DeepSpeed.

Both backends are prepared side by side in every rank (same checkpoint, same batches, same recipe: AdamW,
clipping at 1.0) and alternate step by step, so load from other work on the machine hits them alike. The
first steps (shape inference, DeepSpeed's buffer set-up) are discarded. The script prints each backend's
median step time, the ratio torch/deepspeed, and checks that both report the same first-step loss.

    python benchmarks/bench_pp_backends.py                 # pp=2, m=4, hidden 256, 4 layers, seq 128
    python benchmarks/bench_pp_backends.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"times": times, "first_loss": first_loss}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--per-rank-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.hidden, args.layers, args.seq, args.steps, args.per_rank_batch = 64, 4, 32, 5, 4
    from nd_parallel.testing.launch import launch_for_result
    from nd_parallel.testing.models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model("llama", Path(tmp) / "model", hidden_size=args.hidden, num_hidden_layers=args.layers,
                                intermediate_size=4 * args.hidden, num_attention_heads=8, num_key_value_heads=4,
                                head_dim=args.hidden // 8, tie_word_embeddings=False)
        forwarded = [f"--pp={args.pp}", f"--microbatches={args.microbatches}", f"--per-rank-batch={args.per_rank_batch}",
                     f"--seq={args.seq}", f"--steps={args.steps}", f"--model={model}"]
        data = launch_for_result(__file__, args.pp, forwarded, timeout=1200, env={"DS_ACCELERATOR": "cpu"},
                                 capture=True)
    med = {b: statistics.median(t[args.warmup:]) for b, t in data["times"].items()}
    print(f"pp={args.pp} microbatches={args.microbatches} per-rank batch={args.per_rank_batch} seq={args.seq} "
          f"hidden={args.hidden} layers={args.layers}; {args.steps - args.warmup} timed steps each, alternating")
    print(f"{'backend':<10} {'median step (ms)':>17} {'first-step loss':>16}")
    for backend in med:
        print(f"{backend:<10} {med[backend] * 1e3:>17.1f} {data['first_loss'][backend]:>16.6f}")
    print(f"ratio torch/deepspeed: {med['torch'] / med['deepspeed']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
