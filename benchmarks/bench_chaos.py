"""The long chaos run: `nd-parallel train --max-restarts N` under many faults at random steps, against the same run
left alone. The short version is tests/distributed/test_fault_chaos.py; both use nd_parallel/testing/chaos.py.

Faults (kinds drawn about equally, steps and victims at random from ``--seed``): kill -9 of a rank, a rank dying in
the middle of a checkpoint save, SIGSTOP of a rank, a NaN in one rank's forward, a rank started with a different
model config; with ``--nnodes 2`` also the loss of a whole simulated node (two `nd-parallel train --nnodes 2` on
this machine), replaced by a fresh one. Prints every fault's detection time, restart-to-first-step time and steps
lost, the medians per kind, and whether the final parameters and every logged loss equal the uninterrupted run's
bit for bit (exit status 1 if not).

    python benchmarks/bench_chaos.py                       # FSDP2 on 2 ranks, 12 faults over 160 steps
    python benchmarks/bench_chaos.py --nnodes 2            # HSDP 2x2 on two simulated nodes, node faults too
    python benchmarks/bench_chaos.py --quick               # 4 faults over 40 steps
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import _common

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers, when run from a checkout


def parse_args(argv=None):
    """No --worker: ChaosRun starts `nd-parallel train`, not this script, as the ranks."""
    p = _common.parser(__doc__)
    _common.flags(p, faults=12, steps=160, save_steps=8)
    # not flags(): that types a flag by its default, and 15.0 would change what --json echoes (15) from earlier runs
    p.add_argument("--hang-timeout", type=float, default=15)
    p.add_argument("--nnodes", type=int, default=1, choices=(1, 2))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", help="also write every line the nodes printed to this file")
    return _common.parse(p, argv, quick={"faults": 4, "steps": 40},
                         json_help="also write the measurements to this file", worker=False)


def main(argv=None) -> int:
    import torch
    from safetensors.torch import load_file

    from nd_parallel.testing.chaos import ChaosRun, random_faults, to_json
    from tests.distributed.train_yaml_helpers import write_model_and_data

    args = parse_args(argv)
    rng = random.Random(args.seed)
    kinds = ("kill", "save", "stop", "nan", "mismatch") + (("node",) if args.nnodes > 1 else ())
    faults = random_faults(rng, args.faults, args.steps, kinds)
    layout = {"dp_replicate_size": 2, "dp_shard_size": 2} if args.nnodes > 1 else {"dp_shard_size": 2}
    nproc = 4 if args.nnodes > 1 else 2
    with tempfile.TemporaryDirectory(prefix="nd_parallel_chaos_") as tmp:
        root = Path(tmp)
        data = write_model_and_data(root, n=1000)
        yaml = {"base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}],
                "sequence_len": 32, "micro_batch_size": 2, "max_steps": args.steps, "learning_rate": 0.001,
                "lr_scheduler": "linear", "logging_steps": 1, "save_steps": args.save_steps, "save_total_limit": 3,
                **layout}
        run = ChaosRun(yaml, root, nproc=nproc, nnodes=args.nnodes, hang_timeout=args.hang_timeout,
                       seed=args.seed)
        print(f"chaos: {len(faults)} faults over {args.steps} steps, save every {args.save_steps}, "
              f"{nproc} ranks on {args.nnodes} node(s), hang_timeout {args.hang_timeout:g} s: "
              + ", ".join(f"{f.kind}@{f.step}" for f in faults), flush=True)
        reference = run.reference(nnodes=1)
        try:
            result = run.run(faults)
        finally:
            if args.log:
                Path(args.log).write_text(run.output() + "\n", encoding="utf-8")
        ref_log = [json.loads(x) for x in (reference / "train_log.jsonl").read_text().splitlines()]
        a, b = load_file(str(reference / "model.safetensors")), load_file(str(root / "chaos" / "model.safetensors"))
        same_params = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        same_losses = [r["loss"] for r in result.log] == [r["loss"] for r in ref_log]
    print(result.table())
    print(f"\n{'kind':9} {'n':>3} {'detected (median)':>18} {'restart->step (median)':>23} {'lost (median, max)':>19}")
    for kind in dict.fromkeys(m.kind for m in result.measured):
        ms = [m for m in result.measured if m.kind == kind]
        print(f"{kind:9} {len(ms):3d} {statistics.median(m.detected_s for m in ms):17.2f}s "
              f"{statistics.median(m.restart_to_first_step_s for m in ms):22.2f}s "
              f"{statistics.median(m.steps_lost for m in ms):12.1f}, {max(m.steps_lost for m in ms)}")
    print(f"\nfinal parameters equal the uninterrupted run's: {same_params}; every logged loss equal: {same_losses}; "
          f"{result.seconds:.0f} s with faults")
    _common.write_json(args.json, {**to_json(result), "same_params": same_params, "same_losses": same_losses,
                                   "args": vars(args)})
    return 0 if same_params and same_losses else 1


if __name__ == "__main__":
    sys.exit(main())
