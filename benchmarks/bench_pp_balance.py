"""Per-stage time imbalance with uniform vs profiled layer balancing, on a large-vocabulary model.

A llama with a 32000-token vocabulary, hidden 256 and 8 layers: the lm_head (+ loss) costs several decoder
layers, the embedding's backward (a dense 32000 x 256 gradient) about one. The uniform split gives every
stage 2 layers, so the last stage carries 2 layers *and* the head. ``pp_balance="profile"``
(nd_parallel.distributed.pipeline.balance) measures every unit and moves layers off the head's stage.

For each split, in one 4-rank launch (p=4, 1F1B, m micro-batches of 1 x seq tokens):
  predicted   per-stage fwd+bwd from the profile (median over ranks of each unit's median)
  isolated    each stage's fwd+bwd on one micro-batch, the pp ranks taking turns: what each stage costs on
              a device of its own (on a shared CPU, running them together would mix in core contention)
  pipeline    per-stage work per micro-batch inside real 1F1B steps, from the recorded timeline (all four
              ranks share the machine's cores here, so these are inflated by contention)
and the imbalance max/mean of each, the step time, and the 1F1B step the isolated times predict on four
devices: sum_s t_s + (m - 1) * max_s t_s.

    python benchmarks/bench_pp_balance.py              # vocab 32000, hidden 256, 8 layers, seq 128, m 8
    python benchmarks/bench_pp_balance.py --quick      # smoke run: vocab 8000, seq 32, 1 measured step
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import _common
import torch

P = 4


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, vocab=32000, hidden=256, intermediate=1024, layers=8, seq=128, microbatches=8,
                  steps=(3, "measured steps per split, after 1 warm-up step [3]"),
                  repeats=(5, "repeats per unit / isolated stage measurement [5]"),
                  out=("runs/pp_balance", "timeline traces and pictures [runs/pp_balance]"))
    return _common.parse(p, argv, quick={"vocab": 8000, "seq": 32, "steps": 1, "repeats": 2}, timeout=1200)


def build_model(args):
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.models import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=args.hidden // 8, max_position_embeddings=max(256, args.seq),
                      tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


# --------------------------------------------------------------------------------------------- worker
def build_split(args, counts: list[int]):
    """A prepared PipelineModel of the benchmark model with ``counts`` layers per stage, timeline attached."""
    from accelerate import Accelerator

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.distributed.pipeline.timeline.record import TimelineRecorder, attach

    accelerator = Accelerator()
    plugin = NDParallelPlugin(ParallelismConfig(pp_size=P, pp_microbatches=args.microbatches)).attach(accelerator)
    # ParallelismConfig refuses a list with an empty end stage (split.py allows it); set the list after the
    # checks, as build_pipeline's layer_counts would hand over profile_balance's result.
    plugin.config.pp_balance = counts
    pipe = accelerator.prepare(build_model(args))
    attach(pipe, TimelineRecorder(pipe.mesh["pp"].get_group()))
    return pipe


def measure(args, pipes: dict) -> dict:
    """Both splits measured alternately (A B A B ...), so background load on the machine hits them alike."""
    import torch.distributed as dist

    from nd_parallel.distributed.pipeline.balance.collective import measure_stage_seconds
    from nd_parallel.distributed.pipeline.balance.measure import sample_batch
    from nd_parallel.distributed.pipeline.timeline.analysis import bubble, stage_seconds
    from nd_parallel.distributed.pipeline.timeline.render import write

    any_pipe = next(iter(pipes.values()))
    batch = sample_batch(any_pipe, (1, args.seq))
    group = any_pipe.mesh["pp"].get_group()
    isolated = {name: [] for name in pipes}
    for k in range(1 + args.repeats):
        for name, pipe in pipes.items():
            times = measure_stage_seconds(pipe, batch, group, repeats=1, warmup=0)
            if k > 0:  # round 0 warms up
                isolated[name].append(times)
    ids = torch.randint(1, args.vocab, (args.microbatches, args.seq), generator=torch.Generator().manual_seed(1))
    step_ms = {name: [] for name in pipes}
    for k in range(1 + args.steps):
        for name, pipe in pipes.items():
            dist.barrier()
            t0 = time.perf_counter()
            pipe(input_ids=ids, labels=ids)
            if k > 0:
                step_ms[name].append(1e3 * (time.perf_counter() - t0))
            pipe.zero_grad(set_to_none=True)
    results = []
    for name, pipe in pipes.items():
        per_step, bubbles, last = [], [], None
        for step in range(1, 1 + args.steps):
            events = pipe.timeline.gather(step)
            if events is not None:
                per_step.append(stage_seconds(events))
                bubbles.append(bubble(events, P).mean)
                last = events
        if last is not None:
            write(last, args.out, schedule="1f1b", p=P, m=args.microbatches, name=f"balance_{name}")
        results.append({
            "name": name,
            "isolated": [statistics.median(r[i] for r in isolated[name]) for i in range(P)],
            "pipeline": [statistics.median(s[i] for s in per_step) for i in range(P)] if per_step else [],
            "step_ms": step_ms[name], "bubble": statistics.median(bubbles) if bubbles else None})
    return results


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator

    from nd_parallel.distributed.pipeline.balance.collective import agree_costs, profile_plan
    from nd_parallel.distributed.pipeline.balance.partition import stage_times
    from nd_parallel.distributed.pipeline.split import uniform_layers

    Accelerator()  # initializes the process group (gloo on CPU) from torchrun's environment
    model = build_model(args)
    t0 = time.perf_counter()
    plan, units = profile_plan(model, P, dist.group.WORLD, sample_shape=(1, args.seq), repeats=args.repeats)
    profile_s = time.perf_counter() - t0
    costs = agree_costs([u.seconds for u in units], dist.group.WORLD)  # what profile_plan split on
    del model
    splits = {"uniform": uniform_layers(args.layers, P), "profile": plan.counts}
    results = measure(args, {name: build_split(args, counts) for name, counts in splits.items()})
    for r in results:
        r["counts"] = splits[r["name"]]
        r["predicted"] = stage_times(costs, r["counts"])
    units = [[u.name, c, u.param_bytes, u.activation_bytes] for u, c in zip(units, costs)]
    _common.write_result(args, {"units": units, "profile_s": profile_s, "results": results})


# --------------------------------------------------------------------------------------------- report
def imbalance(xs: list[float]) -> float:
    return max(xs) / (sum(xs) / len(xs))


def one_f_one_b_ms(stage_s: list[float], m: int) -> float:
    """1F1B step on one device per stage: one pass through every stage plus m-1 at the slowest's pace."""
    return 1e3 * (sum(stage_s) + (m - 1) * max(stage_s))


HEAD = ["split", "layers per stage", "predicted ms/stage", "isolated ms/stage", "in-pipeline ms/stage",
        "max/mean predicted", "max/mean isolated", "max/mean in-pipeline", "est. 1F1B step on 4 devices (ms)",
        "measured step here (ms)", "bubble here"]


def report(data: dict, args, took: str) -> str:
    ms = lambda xs: " / ".join(f"{1e3 * x:.1f}" for x in xs)  # noqa: E731
    units = data["units"]
    layer_ms = statistics.median(c for n, c, _, _ in units[1:-1])
    launch = (f"\n[bench] llama vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, p={P}, 1F1B, "
              f"m={args.microbatches} x (1 x {args.seq}); launch took {took}\n")
    lines = [launch,
             f"unit fwd+bwd on 1 x {args.seq} tokens (median over ranks): embed {1e3 * units[0][1]:.2f} ms, "
             f"layer {1e3 * layer_ms:.2f} ms (median), head+loss {1e3 * units[-1][1]:.2f} ms; "
             f"param MiB embed {units[0][2] / 2**20:.1f}, layer {units[1][2] / 2**20:.1f}, head {units[-1][2] / 2**20:.1f}; "
             f"activation MiB per layer {units[1][3] / 2**20:.1f}, head {units[-1][3] / 2**20:.1f}; "
             f"profiling took {data['profile_s']:.1f} s", ""]
    m = args.microbatches
    lines += _common.md_table(HEAD, [
        [r["name"], r["counts"], ms(r["predicted"]), ms(r["isolated"]), ms(r["pipeline"]),
         f"{imbalance(r['predicted']):.2f}", f"{imbalance(r['isolated']):.2f}", f"{imbalance(r['pipeline']):.2f}",
         f"{one_f_one_b_ms(r['isolated'], m):.0f}", f"{statistics.median(r['step_ms']):.0f}",
         f"{100 * r['bubble']:.0f}%"] for r in data["results"]])
    rows = {r["name"]: r for r in data["results"]}
    u, p = rows["uniform"], rows["profile"]
    lines += ["", f"gain of profile over uniform: slowest stage {max(u['isolated']) / max(p['isolated']):.2f}x "
              f"(isolated), {max(u['predicted']) / max(p['predicted']):.2f}x (predicted); estimated 1F1B step on 4 "
              f"devices {one_f_one_b_ms(u['isolated'], m) / one_f_one_b_ms(p['isolated'], m):.2f}x; measured step "
              f"on this machine {statistics.median(u['step_ms']) / statistics.median(p['step_ms']):.2f}x"]
    return "\n".join(lines)


def parent(args, argv) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)  # the ranks write their timelines there
    data, took = _common.launch_timed(__file__, P, argv, timeout=args.timeout)
    print(report(data, args, took))


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
