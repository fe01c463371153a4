"""Validate the planner on mixture-of-experts models: predicted vs measured peak memory per rank, 4 CPU ranks.

The same measurement as bench_planner.py (its tracker, its training step, its report; gloo, fp32), on two tiny MoE
shapes with 8 experts and top-2 routing (Qwen3-MoE, Mixtral) under FSDP4, FSDP2 x TP2 (the plan's
``moe_tp_experts`` splits every expert), EP2 x FSDP4, EP4, TP2 x EP2 (experts whole on both tp ranks) and EP2 x
FSDP4 with full activation checkpointing. The one-process row is a unit test
(tests/unit/test_planner_moe.py::test_moe_prediction_matches_a_measured_step).

Beside the peaks it records how unevenly the router spread the rows over the ep ranks: per MoE call the rows one
rank's experts received over the rows its tokens sent (top-k x tokens; 1 when balanced). The planner counts the
balanced average (each rank's experts receive top-k x its own tokens' rows);
the busiest rank holds up to that ratio more expert activations (`rows max/avg`). `err` compares with the busiest
rank, `err mean` with the mean over the ranks (what a balanced router would give every rank).

    python benchmarks/bench_planner_moe.py                    # 2 shapes x 6 layouts (~10 min on 2 shared cores)
    python benchmarks/bench_planner_moe.py --from-json runs/bench_planner_moe.json   # predict again
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import _common
import bench_planner

SHAPES = {  # name -> (family, overrides)
    "qwen3moe-h192-L3-e8k2": ("qwen3_moe", dict(hidden_size=192, num_hidden_layers=3, num_attention_heads=6,
                                                num_key_value_heads=2, head_dim=32, num_experts=8,
                                                num_experts_per_tok=2, moe_intermediate_size=256,
                                                intermediate_size=512, vocab_size=4096, tie_word_embeddings=False)),
    "mixtral-h128-L4-e8k2": ("mixtral", dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=32, num_local_experts=8,
                                             num_experts_per_tok=2, intermediate_size=384, vocab_size=3000,
                                             tie_word_embeddings=False)),
}
LAYOUTS = {
    "fsdp4": (dict(dp_shard_size=4), {}),
    "fsdp2_tp2": (dict(dp_shard_size=2, tp_size=2), {}),
    "ep2_fsdp4": (dict(dp_shard_size=4, ep_size=2), {}),
    "ep4": (dict(dp_shard_size=4, ep_size=4), {}),
    "tp2_ep2": (dict(dp_shard_size=2, tp_size=2, ep_size=2), {}),
    "ep2_fsdp4_full_ckpt": (dict(dp_shard_size=4, ep_size=2, activation_checkpointing="full"), {}),
}
bench_planner.LAYOUTS.update(LAYOUTS)  # the dense script's _measure and report look layouts up there


def _count_rows() -> dict:
    """Wrap the EP routing: per MoE call, rows received over rows sent on this rank (the forward's imbalance)."""
    from nd_parallel.distributed.expert_parallel import apply

    seen = {"max": 0.0, "sum": 0.0, "calls": 0}
    plan = apply.plan_routing

    def counting(top_k_index, per_rank, group):
        routing = plan(top_k_index, per_rank, group)
        ratio = sum(routing.recv) / max(sum(routing.send), 1)
        seen.update(max=max(seen["max"], ratio), sum=seen["sum"] + ratio, calls=seen["calls"] + 1)
        return routing

    apply.plan_routing = counting
    return seen


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator

    Accelerator()
    import torch

    torch.set_num_threads(1)
    rates = bench_planner._rates(dist)
    results = {"rates": rates, "runs": {}}
    for shape, model_dir in json.loads(args.models).items():
        for name in args.layouts.split(","):
            seen = _count_rows()
            key = f"{shape}/{name}"
            try:
                run = bench_planner._measure(args, model_dir, name, args.seq)
                run["rows_ratio"] = _common.gather(seen["max"]) if seen["calls"] else None
            except Exception as err:  # one broken layout must not hide the others
                run = {"error": f"{type(err).__name__}: {err}"[:400]}
            results["runs"][key] = run
            if dist.get_rank() == 0:
                print(f"measured {key}: {run}", flush=True)
    _common.write_result(args, results)


def print_report(rep: dict) -> None:
    mib = 2.0**20
    print(f"{'shape':<24} {'layout':<20} {'pred MiB':>9} {'meas MiB':>9} {'err':>7} {'ranks min-max':>14} "
          f"{'err mean':>8} {'rows max/avg':>12}  predicted activations / comm (MiB)")
    for row in rep["rows"]:
        if row.get("error"):
            print(f"{row['shape']:<24} {row['layout']:<20} FAILED: {row['error'][:100]}")
            continue
        run = rep["raw"]["runs"][f"{row['shape']}/{row['layout']}"]
        peaks, ratio = row["measured_peaks"], run.get("rows_ratio")
        parts = row["predicted_parts"]
        print(f"{row['shape']:<24} {row['layout']:<20} {row['predicted_peak'] / mib:9.1f} "
              f"{row['measured_peak'] / mib:9.1f} {row['mem_err']:+7.1%} "
              f"{min(peaks) / mib:6.1f}-{max(peaks) / mib:6.1f} {row['predicted_peak'] * len(peaks) / sum(peaks) - 1:+8.1%} "
              f"{max(ratio) if ratio else 1.0:12.2f}  "
              f"{parts['activations'] / mib:.1f} / {parts['comm_buffers'] / mib:.1f}")
    s = bench_planner.summarize(rep["rows"])
    print(f"memory |error| on the MoE rows: median {s['mem_abs_err_median']:.1%}, worst {s['mem_abs_err_worst']:.1%} "
          f"over {s['layouts']} layouts")


def _save_models(args, tmp: str) -> dict[str, str]:
    from nd_parallel.testing.models import save_tiny_model

    return {shape: str(save_tiny_model(SHAPES[shape][0], Path(tmp) / shape, max_position_embeddings=max(args.seq, 256),
                                       **SHAPES[shape][1])) for shape in args.shapes.split(",")}


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, seq=256, global_batch=8, steps=(1, "timed steps per layout after one warm-up"),
                  layouts=",".join(LAYOUTS), shapes=",".join(SHAPES))
    p.add_argument("--from-json", help="re-print a report written by --json")
    return _common.parse(p, argv, json_help="also write the report here", internal=("--models",))


def parent(args, argv) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if args.from_json:  # predict again (the model may have changed) against the stored measurements
            old = json.loads(Path(args.from_json).read_text())
            return print_report(bench_planner.report(old["raw"], args, _save_models(args, tmp)))
        dirs = _save_models(args, tmp)
        forwarded = [f"--seq={args.seq}", f"--global-batch={args.global_batch}", f"--steps={args.steps}",
                     f"--layouts={args.layouts}", f"--models={json.dumps(dirs)}"]
        data = _common.launch_self(__file__, bench_planner.WORLD, forwarded, timeout=3000,
                                   env={"TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"})
        rep = bench_planner.report(data, args, dirs)
    print_report(rep)
    _common.write_json(args.json, rep)


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
