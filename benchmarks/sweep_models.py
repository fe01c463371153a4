"""Every causal-LM model type of the installed transformers under FSDP2, TP2, PP2, CP2 and EP2 (MoE), on 2 gloo
ranks, each cell against one process; writes the matrix to docs/models.md.

    python benchmarks/sweep_models.py                      # every type (about 10 s a type on a quiet 2-core machine)
    python benchmarks/sweep_models.py --ci                 # the subset tests/distributed/test_model_sweep.py runs
    python benchmarks/sweep_models.py --types llama,mixtral --out /tmp/models.md

The same code as the CI test (``nd_parallel.testing.sweep``); cells are match / refused (why) / differs / crash,
types that cannot be built tiny or fail in one process are listed with the reason.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import transformers

from nd_parallel.testing.sweep import causal_lm_types
from nd_parallel.testing.sweep_launch import counts, launch_sweep, markdown

CI_TYPES_FILE = Path(__file__).resolve().parents[1] / "tests" / "distributed" / "sweep_ci_types.txt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ci", action="store_true", help="only the types the CI test runs")
    p.add_argument("--types", default=None, help="comma-separated model types (default: every causal-LM type)")
    p.add_argument("--out", default="docs/models.md")
    p.add_argument("--work", default=None, help="folder for the tiny models and sweep.jsonl (default: a temp dir)")
    p.add_argument("--per-launch", type=int, default=20)
    p.add_argument("--type-timeout", type=float, default=600,
                   help="seconds after which a type that has not finished is recorded as a hang (launch died)")
    p.add_argument("--collective-timeout", type=float, default=300, help="gloo timeout of each collective (s)")
    args = p.parse_args()
    types = (args.types.split(",") if args.types else
             CI_TYPES_FILE.read_text().split() if args.ci else causal_lm_types())
    work = Path(args.work or tempfile.mkdtemp(prefix="nd_parallel_sweep_"))
    start = time.perf_counter()
    records = launch_sweep(types, work, per_launch=args.per_launch, type_timeout=args.type_timeout,
                           collective_timeout=args.collective_timeout)
    took = time.perf_counter() - start
    command = "python benchmarks/sweep_models.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(markdown(records, command.strip(), transformers.__version__))
    for name, c in counts(records).items():
        print(f"{name:6s} {dict(c)}")
    print(f"{len(types)} types in {took:.0f}s ({took / len(types):.1f}s a type); matrix in {args.out}; work {work}")


if __name__ == "__main__":
    main()
