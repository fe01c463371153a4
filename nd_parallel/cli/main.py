"""`nd-parallel demo | train | make-tiny`: start the ranks, train, report.

This module is the argument parser and the dispatch. The commands: demo.py, train/command.py (with the rest of
train/), plan.py, tools.py (make-tiny, export); ranks.py chooses and starts the ranks, report.py prints the tables.
"""

from __future__ import annotations

import argparse
import sys

from nd_parallel.config import ConfigError


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0; e.g. --max-restarts 3")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1; e.g. --nnodes 2")
    return int(text)


def _add_demo(sub, families) -> argparse.ArgumentParser:
    from .demo import cmd_demo

    demo = sub.add_parser("demo", help="train a tiny model under a layout and compare it with one process")
    demo.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    demo.add_argument("--layout", default="fsdp2_tp2", help="e.g. ddp2, fsdp2, hsdp2x2, tp2, fsdp2_tp2, hsdp2x2_tp2")
    demo.add_argument("--family", default="llama", choices=families, help="tiny model family (llama)")
    demo.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default 32)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    return demo


def _add_train(sub) -> argparse.ArgumentParser:
    from .train.command import cmd_train

    train = sub.add_parser("train", help="train from an Axolotl YAML file (transformers.Trainer + nd_parallel)")
    train.add_argument("config", help="Axolotl YAML: base_model, datasets, ... and the parallel sizes")
    train.add_argument("--max-restarts", type=_count, default=0,
                       help="after a rank fails, restart every rank up to N times from the latest complete "
                            "checkpoint (torchrun's elastic agent; needs save_steps or saves_per_epoch) [0]")
    train.add_argument("--nnodes", type=_positive, default=1,
                       help="run one nd-parallel train per node, this many nodes; --nproc is the total [1]")
    train.add_argument("--rdzv-endpoint", help="HOST:PORT where the nodes meet (torchrun's c10d rendezvous, served "
                                               "by the node HOST names); the same on every node")
    train.add_argument("--rdzv-id", default="nd_parallel", help="the job's id, the same on every node [nd_parallel]")
    train.add_argument("--rdzv-conf", help="torchrun's --rdzv-conf, e.g. keep_alive_interval=1,join_timeout=900")
    train.set_defaults(func=cmd_train)
    return train


def _add_tools(sub, families) -> None:
    from .tools import cmd_export, cmd_make_tiny

    tiny = sub.add_parser("make-tiny", help="write a tiny checkpoint and a text file to train on")
    tiny.add_argument("directory")
    tiny.add_argument("--family", default="llama", choices=families)
    tiny.add_argument("--lines", type=int, default=2000, help="lines of text (default 2000)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny)
    export = sub.add_parser("export", help="write HF safetensors from an accelerator.save_state checkpoint")
    export.add_argument("checkpoint", help="directory written by accelerator.save_state under nd_parallel")
    export.add_argument("output", help="directory for config.json + *.safetensors (from_pretrained loads it)")
    export.add_argument("--max-shard-size", default="10GB", help="largest safetensors file (default 10GB)")
    export.set_defaults(func=cmd_export)


def build_parser() -> argparse.ArgumentParser:
    from nd_parallel.testing.models import FAMILIES

    from .plan import add_parser as add_plan_parser

    parser = argparse.ArgumentParser(prog="nd-parallel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in (_add_demo(sub, sorted(FAMILIES)), _add_train(sub)):  # the commands that start ranks
        cmd.add_argument("--nproc", type=int, help="number of ranks (default: what the layout needs)")
        cmd.add_argument("--cpu", action="store_true", help="use CPU ranks (gloo) even when GPUs are visible")
        cmd.add_argument("--timeout", type=float, help="kill every rank after this many seconds")
        cmd.add_argument("--verbose", action="store_true", help="show the libraries' warnings and loading bars")
    _add_tools(sub, sorted(FAMILIES))
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "timeout", 0) is None:  # a demo that hangs is a bug; training may take days
        args.timeout = 600 if args.command == "demo" else 30 * 24 * 3600
    try:
        return args.func(args)
    except (ConfigError, NotImplementedError, TimeoutError, RuntimeError) as err:
        print(f"nd-parallel {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
