"""What sequence parallelism's collectives cost against plain TP's, on this machine's backend.

Per TP region (attention, MLP) plain TP issues one all-reduce of the region's output (b x s x h) in forward and one
in backward. Sequence parallelism (Megatron / torchtitan) replaces it with an all-gather of the region's input and a
reduce-scatter of its output, each way. With ring algorithms (NCCL) a reduce-scatter plus an all-gather move exactly
the bytes of one all-reduce, which is *made of* those two halves, so SP costs no extra communication there. This
script measures the ratio ``(reduce_scatter + all_gather) / all_reduce`` on the machine's backend for the
activation sizes of ``bench_fsdp_tp.py``'s model and larger ones, so the SP row of that benchmark can be read: gloo's
reduce-scatter is not half an all-reduce.

The three collectives alternate call by call (``all_reduce, reduce_scatter, all_gather, all_reduce, ...``) after a
warm-up, so machine noise hits them alike; each figure is the median over the calls of the slowest rank.

    python benchmarks/bench_sp_collectives.py                 # tp 2 and 4, gloo (NCCL where CUDA is there)
    python benchmarks/bench_sp_collectives.py --quick         # smoke run
"""

from __future__ import annotations

import statistics
import sys
import time

import _common
import torch

# (label, elements): bench_fsdp_tp's region output (2 samples x 128 tokens x hidden 256), then 4x and 16x it.
SIZES = (("b2 s128 h256", 2 * 128 * 256), ("b2 s512 h256", 2 * 512 * 256), ("b2 s2048 h256", 2 * 2048 * 256))


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, calls=(30, "timed calls per collective and size"), tp=("2,4", "group sizes, comma-separated"))
    return _common.parse(p, argv, quick={"calls": 5, "tp": "2"}, json_help="write the raw numbers here",
                         timeout=600.0)


def _all_gather(out, inp) -> None:
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor (deprecated, same signature) to all_gather_single
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp)


def _timed(fn, device) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def worker(args) -> None:
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    rows = []
    for label, numel in SIZES:
        whole = torch.randn(numel, device=device)
        part = torch.empty(numel // world, device=device)
        ops = {"all_reduce": lambda: dist.all_reduce(whole),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole),
               "all_gather": lambda: _all_gather(whole, part)}
        times = {name: [] for name in ops}
        for i in range(args.calls + 3):
            for name, fn in ops.items():
                took = _timed(fn, device)
                if i >= 3:
                    times[name].append(took)
        slowest = {n: [max(ts) for ts in zip(*_common.gather(t))] for n, t in times.items()}
        med = {n: statistics.median(ts) * 1e6 for n, ts in slowest.items()}
        rows.append({"size": label, "bytes": numel * 4, **{f"{n}_us": med[n] for n in ops},
                     "ratio": (med["reduce_scatter"] + med["all_gather"]) / med["all_reduce"]})
    _common.write_result(args, {"backend": dist.get_backend(), "world": world, "rows": rows})
    dist.destroy_process_group()


def parent(args, argv) -> None:
    results = []
    for tp in (int(t) for t in args.tp.split(",")):
        res, took = _common.launch_timed(__file__, tp, [f"--calls={args.calls}"], timeout=args.timeout)
        print(f"   tp {tp}: launch took {took}", file=sys.stderr, flush=True)
        results.append(res)
    rows = [[f"{r['backend']} x{r['world']}", row["size"], f"{row['bytes'] / _common.MB:.2f}",
             f"{row['all_reduce_us']:.0f}", f"{row['reduce_scatter_us']:.0f}", f"{row['all_gather_us']:.0f}",
             f"{row['ratio']:.2f}"] for r in results for row in r["rows"]]
    _common.print_report(f"SP's collectives against TP's, median of {args.calls} calls (slowest rank)",
                         ["group", "tensor", "MiB", "all-reduce µs", "reduce-scatter µs", "all-gather µs",
                          "(RS + AG) / AR"], rows, results)
    _common.write_json(args.json, results)


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
