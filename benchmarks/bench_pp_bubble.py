"""Measured vs analytical pipeline bubble of every schedule, on 4 pipeline ranks, in one launch.

Each decoder layer of a tiny llama is made to *sleep* for a fixed time in forward, in its input-gradient
backward and in its weight-gradient backward (custom autograd functions), so stage times are set by the
benchmark, not by how many cores the machine has: 4+ stages are measurable on 2 cores. The pipeline is
the real one — NDParallelPlugin + accelerator.prepare + torch.distributed.pipelining — and the timeline is
recorded by nd_parallel.distributed.pipeline.timeline. Every rank runs the same work per micro-batch under every
schedule (8 layers over 4 ranks: 2 layers per stage with 1 stage per rank, 1 layer per stage with 2),
so the step times are comparable too.

    python benchmarks/bench_pp_bubble.py                  # p=4, m in {4, 8}, F=B=W=10 ms per layer
    python benchmarks/bench_pp_bubble.py --quick          # smoke run: 2 ms sleeps, 1 measured step
    python benchmarks/bench_pp_bubble.py --out runs/pp_bubble   # where the traces and pictures go
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import _common
import torch

P = 4
LAYERS = 8
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2)]


def parse_args(argv):
    p = _common.parser(__doc__)
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    _common.flags(p, f_ms=(10.0, "forward sleep per layer [10]"),
                  b_ms=(10.0, "input-gradient backward sleep per layer [10]"),
                  w_ms=(10.0, "weight-gradient backward sleep per layer [10]"),
                  steps=(5, "measured steps per run, after 1 warm-up step [5]"),
                  out=("runs/pp_bubble", "traces (.json) and pictures (.png) [runs/pp_bubble]"))
    return _common.parse(p, argv, quick={"f_ms": 2.0, "b_ms": 2.0, "w_ms": 2.0, "steps": 1},
                         quick_help="smoke run: 2 ms sleeps, 1 measured step", timeout=900)


# ----------------------------------------------------------------------------------------- sleeping model
class Sleep(torch.autograd.Function):
    """Identity that sleeps ``fwd_s`` in forward and ``bwd_s`` when its gradient is computed."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


def make_layer_sleep(layer: torch.nn.Module, f_s: float, b_s: float, w_s: float) -> None:
    """F sleeps f_s; the input gradient sleeps b_s; the weight gradient (a branch that only the dummy
    parameter ``sleep_w`` depends on, so a zero-bubble B skips it and its W runs it) sleeps w_s."""
    layer.register_parameter("sleep_w", torch.nn.Parameter(torch.zeros(())))
    original = layer.forward

    def forward(hidden_states, *args, **kwargs):
        out = original(Sleep.apply(hidden_states, f_s, b_s), *args, **kwargs)
        return out + 0.0 * Sleep.apply(layer.sleep_w, 0.0, w_s)

    layer.forward = forward


def build_model(args):
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, head_dim=8,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    for layer in model.model.layers:
        make_layer_sleep(layer, args.f_ms / 1e3, args.b_ms / 1e3, args.w_ms / 1e3)
    return model


# --------------------------------------------------------------------------------------------- worker
def nominal_duration(args, events, v: int):
    """The sleeps each recorded action was meant to take: the schedule's own bubble under ``replay``."""
    layers = LAYERS // (P * v)  # per stage
    split = {e.stage for e in events if e.kind == "W"}  # stages whose backward is split into B + W

    def duration(e) -> float:
        if e.kind == "F":
            return layers * args.f_ms
        if e.stage not in split:  # a full backward
            return layers * (args.b_ms + args.w_ms) if e.kind == "B" else 0.0
        if e.stage == 0:  # torch runs stage 0's whole backward in W (its input needs no gradient)
            return 0.0 if e.kind == "B" else layers * (args.b_ms + args.w_ms)
        return layers * (args.b_ms if e.kind == "B" else args.w_ms)

    return duration


def run_one(args, schedule: str, v: int, m: int) -> dict:
    import torch.distributed as dist
    from accelerate import Accelerator

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.distributed.pipeline.timeline.analysis import bubble, replay, summarize
    from nd_parallel.distributed.pipeline.timeline.record import TimelineRecorder, attach
    from nd_parallel.distributed.pipeline.timeline.render import write

    accelerator = Accelerator()
    config = ParallelismConfig(pp_size=P, pp_schedule=schedule, pp_virtual_stages=v, pp_microbatches=m)
    plugin = NDParallelPlugin(config).attach(accelerator)
    model = accelerator.prepare(build_model(args))
    recorder = attach(model, TimelineRecorder(model.mesh["pp"].get_group()))
    ids = torch.randint(1, 256, (m, 16), generator=torch.Generator().manual_seed(0))
    step_s = []
    for _ in range(1 + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids)
        step_s.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    summaries, kept = [], []
    for step in range(1, 1 + args.steps):  # step 0 pays for shape inference and warm-up
        events = recorder.gather(step)
        if events is not None:
            summaries.append(summarize(events, schedule, P, m, v))
            summaries[-1]["replayed"] = bubble(replay(events, nominal_duration(args, events, v)), P).mean
            kept.append(events)
    best = min(range(len(summaries)), key=lambda i: summaries[i]["bubble_mean"]) if summaries else None
    if best is not None:  # the picture: the step least disturbed by other load on the machine
        write(kept[best], args.out, schedule=schedule, p=P, m=m, v=v, name=f"{schedule}_m{m}")
    del plugin
    return {"schedule": schedule, "v": v, "m": m, "bubbles": [s["bubble_mean"] for s in summaries],
            "per_rank": summaries[best]["bubble_per_rank"] if summaries else {},
            "replayed": statistics.median(s["replayed"] for s in summaries) if summaries else None,
            "analytical": summaries[0]["bubble_analytical"] if summaries else None,
            "span_ms": [s["span_ms"] for s in summaries], "step_ms": [1e3 * t for t in step_s[1:]]}


def worker(args) -> None:
    _common.write_result(args, [run_one(args, schedule, v, m) for m in args.microbatches for schedule, v in SCHEDULES])


# --------------------------------------------------------------------------------------------- report
def ideal_step_ms(args, m: int) -> float:
    """Work per rank if there were no bubble: m micro-batches x 2 layers x (F + B + W)."""
    return m * (LAYERS // P) * (args.f_ms + args.b_ms + args.w_ms)


def report(results: list[dict], args, took: str) -> str:
    head = ["schedule", "v", "m", f"measured bubble, median of {args.steps} steps", "best step",
            "per rank (best step)", "replayed: recorded order, nominal times, instant comm", "analytical",
            "F..B/W span ms", "step ms", "work per rank ms"]
    rows = []
    for r in results:
        analytic = f"{100 * r['analytical']:.1f}%" if r["analytical"] is not None else "~0 (zero-bubble)"
        per_rank = " / ".join(f"{100 * float(x):.0f}" for x in r["per_rank"].values())
        rows.append([r["schedule"], r["v"], r["m"], f"{100 * statistics.median(r['bubbles']):.1f}%",
                     f"{100 * min(r['bubbles']):.1f}%", per_rank, f"{100 * r['replayed']:.1f}%", analytic,
                     f"{statistics.median(r['span_ms']):.0f}", f"{statistics.median(r['step_ms']):.0f}",
                     f"{ideal_step_ms(args, r['m']):.0f}"])
    launch = (f"\n[bench] p={P}, {LAYERS} layers, sleeps per layer F={args.f_ms} B={args.b_ms} W={args.w_ms} ms; "
              f"launch took {took}; traces and pictures in {args.out}/\n")
    return "\n".join([launch, *_common.md_table(head, rows)])


def parent(args, argv) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)  # the ranks write traces and pictures there
    results, took = _common.launch_timed(__file__, P, argv, timeout=args.timeout)
    print(report(results, args, took))


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
