"""Where a layout's measured peak goes: the live storages at the peak of one training step, by the op that made them
(forward or backward, shape, dtype), on the busiest rank, beside the planner's parts at its predicted moment. How
the planner's terms are checked against a measurement (docs/benchmarks.md, "per-op breakdown"); bench_planner.py's
layouts, shapes and batch, its tracker with ``breakdown=True`` (planner/measure.py: slower, so not in the sweep).

    python benchmarks/bench_planner_breakdown.py --layouts fsdp2_tp2 --shapes qwen3-h192-L4-v8192-tied
"""

from __future__ import annotations

import json
import sys
import tempfile

import _common
import bench_planner as bp

TOP = 25  # labels printed per run, largest first


def worker(args) -> None:
    import nd_parallel.planner.measure as measure

    class Tracker(measure.LiveTensorBytes):
        last = None

        def __init__(self, initial):
            super().__init__(initial, breakdown=True)
            Tracker.last = self

    measure.LiveTensorBytes = Tracker  # bench_planner._measure imports it at each call
    measure_one = bp._measure

    def _measure(*a, **kw):
        out = measure_one(*a, **kw)
        out["at_peak"] = _common.gather(Tracker.last.at_peak)
        return out

    bp._measure = _measure
    bp.worker(args)


def parent(args, argv) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dirs = bp._save_models(args, tmp)
        forwarded = [f"--seq={args.seq}", f"--global-batch={args.global_batch}", "--steps=1",
                     f"--layouts={args.layouts}", f"--models={json.dumps(dirs)}",
                     f"--seqs={json.dumps({shape: bp._seq(shape, args) for shape in dirs})}"]
        data = _common.launch_self(__file__, bp.WORLD, forwarded, timeout=3000,
                                   env={"TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"})
        bp.summarize = lambda rows: {}  # one layout per shape: no ranking to summarise
        rep = bp.report(data, args, dirs)
    mib = 2.0**20
    for row in rep["rows"]:
        run = data["runs"][f"{row['shape']}/{row['layout']}"]
        if row.get("error"):
            print(f"{row['shape']}/{row['layout']}: FAILED {row['error']}")
            continue
        rank = max(range(len(run["peaks"])), key=lambda r: run["peaks"][r])
        print(f"\n{row['shape']}/{row['layout']}: measured {row['measured_peak'] / mib:.2f} MiB (rank {rank}), "
              f"predicted {row['predicted_peak'] / mib:.2f} MiB at {row['predicted_phase']}")
        for label, nbytes in sorted(run["at_peak"][rank].items(), key=lambda kv: -kv[1])[:TOP]:
            print(f"  {nbytes / mib:8.3f}  {label}")
        print("  predicted: " + ", ".join(f"{k} {v / mib:.2f}" for k, v in row["predicted_parts"].items() if v))
    _common.write_json(args.json, {"rows": rep["rows"], "raw": data})


if __name__ == "__main__":
    sys.exit(_common.run(bp.parse_args, worker, parent))
