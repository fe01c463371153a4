"""`nd-parallel demo | train | make-tiny`: start the ranks, train, report.

The parent process prepares everything that can fail (layout, YAML, model directory, tokenized data) before
any rank starts, launches the ranks with torchrun (`launch.py`), and reads back the file rank 0 writes.
Run under a launcher already (torchrun, `accelerate launch`, SLURM), each rank does the same work itself
and rank 0 prints the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from nd_parallel.config import RUN_OPTIONS, ConfigError, ParallelismConfig

from .train.config import TrainConfig, load_train_config, read_yaml_mapping  # noqa: F401 (public: tests, plan_cli)

_TOKEN = re.compile(r"(ddp|fsdp|hsdp|tp|cp|pp)(\d*)(?:x(\d+))?")
_SIZE_OF = {"ddp": "dp_replicate_size", "fsdp": "dp_shard_size", "tp": "tp_size", "cp": "cp_size", "pp": "pp_size"}
TOLERANCE = 1e-5  # the parity matrix's tolerances (ARCHITECTURE.md), quoted next to the demo's numbers


# ---------------------------------------------------------------------------------------------- ranks
def parse_layout(name: str) -> dict[str, int]:
    """ParallelismConfig kwargs of a layout name: '_'-joined ddpN, fsdpN (fsdp = the ranks left), hsdpRxS, tpN,
    cpN, ppN; e.g. fsdp2_tp2 -> dp_shard_size=2, tp_size=2."""
    kwargs: dict[str, int] = {}
    for token in name.split("_"):
        match = _TOKEN.fullmatch(token)
        kind, a, b = match.groups() if match else (None, "", None)
        if kind == "hsdp" and a and b:
            sizes = {"dp_replicate_size": int(a), "dp_shard_size": int(b)}
        elif kind in _SIZE_OF and b is None and (a or kind == "fsdp"):
            sizes = {_SIZE_OF[kind]: int(a) if a else -1}
        else:
            raise ConfigError(f"layout {name!r}: cannot read {token!r}; join ddpN, fsdpN, hsdpRxS, tpN, cpN, ppN "
                              "with '_', e.g. ddp2, fsdp2, hsdp2x2, tp2, fsdp2_tp2, hsdp2x2_tp2")
        if set(sizes) & set(kwargs):
            raise ConfigError(f"layout {name!r} sets {', '.join(sorted(set(sizes) & set(kwargs)))} twice")
        kwargs.update(sizes)
    return kwargs


def _inside_launched_rank() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_ranks(config: ParallelismConfig, nproc: int | None, force_cpu: bool, cpu_fallback: bool, nnodes: int = 1):
    """(resolved config, number of ranks, "cuda" or "cpu"). GPUs are used when there are enough of them on this node
    for its share of the ranks (``nproc / nnodes``; every node runs as many)."""
    import torch

    if _inside_launched_rank():
        return config.resolve(int(os.environ["WORLD_SIZE"])), int(os.environ["WORLD_SIZE"]), "launched"
    gpus = 0 if force_cpu else torch.cuda.device_count()
    if nproc is None and config.dp_shard_size == -1:  # "the ranks left over": every GPU, or 2-way on CPU
        others = math.prod(size for dim, size in config.sizes.items() if dim != "dp_shard")
        if not (gpus and gpus * nnodes % others == 0) and not cpu_fallback:
            raise ConfigError("dp_shard_size=-1 takes the ranks left over, so give the number of ranks: --nproc N")
        nproc = gpus * nnodes if gpus and gpus * nnodes % others == 0 else 2 * others
    nproc = nproc if nproc is not None else config.world_size
    config = config.resolve(nproc)
    if nproc % nnodes:
        raise ConfigError(f"{nproc} ranks do not split over --nnodes {nnodes}: every node starts the same number "
                          f"of ranks; use a layout (or --nproc) that is a multiple of {nnodes}")
    local = nproc // nnodes
    if gpus >= local:
        return config, nproc, "cuda"
    if gpus and not cpu_fallback:
        raise ConfigError(f"the layout needs {local} ranks per node but {gpus} GPU(s) are visible; pass --cpu to "
                          "train on CPU ranks, or use a layout with fewer ranks")
    if gpus:
        print(f"nd-parallel: {local} ranks do not fit {gpus} GPU(s); running on CPU ranks (gloo)")
    return config, nproc, "cpu"


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0; e.g. --max-restarts 3")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1; e.g. --nnodes 2")
    return int(text)


def _run_job(job: dict, nproc: int, device: str, tmp: Path, timeout: float, max_restarts: int = 0,
             nodes=None) -> dict | None:
    """Every rank's results (rank 0's file), or None where rank 0 is not here: on the other ranks of an outer
    launcher, and on the other nodes of a multi-node launch (``nodes``: ``launch.Nodes``)."""
    import json

    import torch

    from nd_parallel.fault.launch import launch

    from .train import rank as train

    if device == "launched":
        return train.run_rank(job)
    job["results"] = str(tmp / "results.pt")
    (tmp / "job.json").write_text(json.dumps(job))
    env = {}
    if job.get("quiet"):
        env.update(TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONWARNINGS="ignore")
    if device == "cpu" and torch.cuda.is_available():
        env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="true")
    local = nproc // nodes.nnodes if nodes else nproc
    launch(train.__name__, local, [str(tmp / "job.json")], timeout=timeout, env=env, max_restarts=max_restarts,
           nodes=nodes)
    if nodes and not os.path.isfile(job["results"]):  # rank 0 ran on another node, which prints the summary
        print(f"nd-parallel: this node's {local} ranks finished; the node that held rank 0 prints the summary")
        return None
    return torch.load(job["results"], weights_only=True)


# ---------------------------------------------------------------------------------------------- reports
def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _loss_lines(losses: list[float], per_line: int = 10) -> list[str]:
    return [f"{i + 1}-{min(i + per_line, len(losses))}:".ljust(7) + " ".join(f"{x:.4f}" for x in losses[i:i + per_line])
            for i in range(0, len(losses), per_line)]


def _memory_lines(ranks: list[dict], unsharded: int) -> list[str]:
    """One line per rank; the share of one unsharded process when that is known (0: no safetensors)."""
    lines = []
    for r, b in enumerate(info["bytes"] for info in ranks):
        total = b["params"] + b["optimizer"]
        share = f" ({100 * total / unsharded:.1f}% of unsharded)" if unsharded else ""
        lines.append(f"rank {r}: {_bytes(b['params'])} params + {_bytes(b['optimizer'])} AdamW = {_bytes(total)}"
                     + share)
    return lines


def _table(title: str, rows: list[tuple[str, str | list[str]]]) -> str:
    width = max(len(k) for k, _ in rows) + 2
    out = [title, "-" * len(title)]
    for key, value in rows:
        values = value if isinstance(value, list) else [value]
        out += [(key if i == 0 else "").ljust(width) + v for i, v in enumerate(values)]
    return "\n".join(out)


def _verdict(x: float) -> str:
    return f"{x:.2e}   {'ok' if x <= TOLERANCE else 'ABOVE'} (tolerance {TOLERANCE:g})"


def _spread(ranks: list[dict]) -> float:
    first = ranks[0]["losses"]
    return max(abs(a - b) for r in ranks for a, b in zip(r["losses"], first))


# ---------------------------------------------------------------------------------------------- commands
def cmd_demo(args) -> int:
    import torch

    from nd_parallel.testing.models import make_samples, save_tiny_model
    from nd_parallel.testing.parity import Recipe, RunResult, compare, train_reference

    from .train.rank import checkpoint_numel

    config, nproc, device = choose_ranks(ParallelismConfig(**parse_layout(args.layout)), args.nproc, args.cpu,
                                         cpu_fallback=True)
    recipe = Recipe(steps=args.steps, per_rank_batch=2, lr=1e-3)
    with tempfile.TemporaryDirectory(prefix="nd-parallel-demo-") as tmp:
        tmp = Path(tmp)
        model_dir = str(save_tiny_model(args.family, tmp / "model", seed=args.seed))
        samples = make_samples(args.steps * recipe.per_rank_batch * config.dp_size, args.seq_len, seed=args.seed)
        if device != "launched":
            torch.save(samples, tmp / "samples.pt")
        job = {"kind": "demo", "name": args.layout, "layout": config.to_dict(), "model_dir": model_dir,
               "samples": samples if device == "launched" else str(tmp / "samples.pt"),
               "recipe": dataclasses.asdict(recipe), "steps": args.steps, "quiet": not args.verbose}
        start = time.perf_counter()
        results = _run_job(job, nproc, device, tmp, args.timeout)
        if results is None:
            return 0
        trained = time.perf_counter() - start
        torch.set_num_threads(1)  # a tiny model: more threads only add overhead (10x on a busy 2-core machine)
        ref = train_reference(model_dir, samples, config.dp_size, recipe)
        diff = compare(ref, RunResult(results["losses"], results["norms"], results["state"]))
        referenced = time.perf_counter() - start - trained
        n_params = checkpoint_numel(model_dir)
    unsharded = 3 * 4 * n_params  # fp32 parameters + the two AdamW moments
    where = results["ranks"][0]["device"].split(":")[0]
    rows = [
        ("layout", f"{args.layout}: {results['layout']}, {nproc} {where.upper()} ranks"),
        (f"loss per step ({args.steps})", _loss_lines(results["losses"])),
        ("max loss rel diff", _verdict(diff["loss_rel"])),
        ("max param abs diff", _verdict(diff["param_abs"])),
        ("max grad-norm rel diff", _verdict(diff["norm_rel"])),
        ("loss spread over ranks", f"{_spread(results['ranks']):.1e} (the same number on every rank)"),
        ("params + AdamW per rank", _memory_lines(results["ranks"], unsharded)),
        ("unsharded (1 process)", f"{_bytes(unsharded)} = {n_params:,} params x 3 (param + 2 AdamW moments), fp32"),
        ("time", f"{trained:.1f} s launch + train, {referenced:.1f} s single-process reference"),
    ]
    print(_table(f"nd-parallel demo: tiny {args.family}, {args.steps} AdamW steps vs one process "
                 "on the same global batches", rows))
    worst = max(diff.values())
    return 0 if worst <= TOLERANCE else 1


def resolve_train_layout(cfg, path, nproc: int | None, cpu: bool, nnodes: int = 1):
    """(resolved layout, number of ranks, device) of a loaded train config; applies layout: auto and lr_scaling."""
    import torch

    if cfg.layout == "auto":  # the planner's top plan for the ranks launched (plan_cli.py)
        from .plan import auto_train_layout

        nproc_auto = int(os.environ["WORLD_SIZE"]) if _inside_launched_rank() else nproc
        use_cuda = not cpu and torch.cuda.is_available()
        planned, _ = auto_train_layout(cfg, path, nproc_auto, "cuda" if use_cuda else "cpu")
        # the planner chooses the layout; how the run reacts to faults stays what the YAML says
        cfg.parallel = dataclasses.replace(planned, **{k: getattr(cfg.parallel, k) for k in RUN_OPTIONS})
        cfg.parallel.plan = planned.plan
    config, nproc, device = choose_ranks(cfg.parallel, nproc, cpu, cpu_fallback=False, nnodes=nnodes)
    if cfg.lr_scaling:
        from .plan import scaled_learning_rate

        cfg.learning_rate = scaled_learning_rate(
            cfg, path, cfg.micro_batch_size * cfg.gradient_accumulation_steps * config.dp_size)
    return config, nproc, device


def _nodes(args):
    """``launch.Nodes`` for ``--nnodes N --rdzv-endpoint HOST:PORT`` (one `nd-parallel train` per node), else None."""
    from nd_parallel.fault.launch import Nodes

    if args.nnodes == 1:
        if args.rdzv_endpoint:
            raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint} without --nnodes: give the number of nodes, "
                              "e.g. --nnodes 2 (one nd-parallel train per node, each with the same endpoint)")
        return None
    if not args.rdzv_endpoint:
        raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node: the "
                          "address of the node that serves the rendezvous (e.g. the first node of the allocation)")
    if _inside_launched_rank():
        raise ConfigError("--nnodes under an outer launcher: the launcher (torchrun, srun) already starts the "
                          "nodes; leave --nnodes and --rdzv-endpoint out")
    try:
        return Nodes(args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.rdzv_conf)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _main_rank() -> bool:
    return not _inside_launched_rank() or int(os.environ.get("RANK", "0")) == 0


def cmd_train(args) -> int:
    from .train.job import build_job
    from .train.rank import checkpoint_numel

    cfg = load_train_config(args.config)
    nodes = _nodes(args)
    config, nproc, device = resolve_train_layout(cfg, args.config, args.nproc, args.cpu, nodes.nnodes if nodes else 1)
    if cfg.unused and _main_rank():
        print(f"nd-parallel train: accepted, not used: {', '.join(cfg.unused)}")
    with tempfile.TemporaryDirectory(prefix="nd-parallel-train-") as tmp:
        tmp = Path(tmp)
        # Under an outer launcher every rank prepares the same data (deterministic); the cache then serves it.
        job, prepared = build_job(args.config, cfg, config, str(tmp), quiet=not args.verbose)
        if _main_rank():
            print(f"nd-parallel train: {prepared.train_rows} training / {prepared.eval_rows} evaluation rows of <= "
                  f"{cfg.sequence_len} tokens ({prepared.tokenizer_how}{', cached' if prepared.cached else ''}) on "
                  f"{config.describe()}")
        start = time.perf_counter()
        results = _run_job(job, nproc, device, tmp, args.timeout, args.max_restarts, nodes)
    if results is None:
        return 0
    saved = sorted(p.name for p in Path(cfg.output_dir).iterdir())
    unsharded = 3 * 4 * checkpoint_numel(cfg.base_model) if cfg.adapter is None else 0
    rows = [("layout", f"{results['layout']}, {nproc} {results['ranks'][0]['device'].split(':')[0].upper()} ranks"),
            ("data", prepared.sources),
            (f"loss per step ({len(results['losses'])})", _loss_lines(results["losses"])),
            *([("eval loss", " ".join(f"{x:.4f}" for x in results["eval_losses"]))] if results["eval_losses"] else []),
            (f"{'adapter' if cfg.adapter else 'params'} + AdamW per rank", _memory_lines(results["ranks"], unsharded)),
            ("saved", f"{cfg.output_dir}: {', '.join(saved)}"),
            *([("not used", ", ".join(cfg.unused))] if cfg.unused else []),
            ("time", f"{time.perf_counter() - start:.1f} s")]
    print(_table(f"nd-parallel train: {args.config}", rows))
    return 0


def cmd_make_tiny(args) -> int:
    import json

    from nd_parallel.testing.models import make_text, save_tiny_model
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    root = Path(args.directory)
    model = save_tiny_model(args.family, root / "model", seed=args.seed)
    lines = make_text(args.lines, seed=args.seed)
    train_tiny_tokenizer(lines).save_pretrained(model)  # a BPE under the tiny vocabulary, with a chat template
    (root / "data.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines), encoding="utf-8")
    chats = [{"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b}]}
             for a, b in zip(lines[::2], lines[1::2])]
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    alpaca = [{"instruction": a, "input": "", "output": b} for a, b in zip(lines[::2], lines[1::2])]
    (root / "alpaca.json").write_text(json.dumps(alpaca), encoding="utf-8")
    print(f"wrote a tiny {args.family} checkpoint with a tiny BPE tokenizer (ChatML template) to {model}\n"
          f"and {args.lines} lines of text to {root / 'data.txt'} and {root / 'data.jsonl'}, as conversations to "
          f"{root / 'chat.jsonl'} and as alpaca records to {root / 'alpaca.json'}")
    return 0


def cmd_export(args) -> int:
    """HF safetensors from a save_state checkpoint, offline: one process, one tensor in memory at a time."""
    from nd_parallel.checkpoint import CheckpointError, export_checkpoint

    start = time.perf_counter()
    try:
        summary = export_checkpoint(args.checkpoint, args.output, max_shard_size=args.max_shard_size)
    except CheckpointError as err:
        print(f"nd-parallel export: error: {err}", file=sys.stderr)
        return 2
    rows = [("model", f"{summary['model_class']} after {summary['step']} optimizer steps"),
            ("tensors", f"{summary['tensors']} ({_bytes(summary['bytes'])})"),
            ("files", summary["files"]), ("time", f"{time.perf_counter() - start:.1f} s"),
            ("load with", f"AutoModelForCausalLM.from_pretrained('{args.output}')")]
    print(_table(f"nd-parallel export: {args.checkpoint} -> {args.output}", rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from nd_parallel.testing.models import FAMILIES

    parser = argparse.ArgumentParser(prog="nd-parallel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny model under a layout and compare it with one process")
    demo.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    demo.add_argument("--layout", default="fsdp2_tp2", help="e.g. ddp2, fsdp2, hsdp2x2, tp2, fsdp2_tp2, hsdp2x2_tp2")
    demo.add_argument("--family", default="llama", choices=sorted(FAMILIES), help="tiny model family (llama)")
    demo.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default 32)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
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
    for cmd in (demo, train):
        cmd.add_argument("--nproc", type=int, help="number of ranks (default: what the layout needs)")
        cmd.add_argument("--cpu", action="store_true", help="use CPU ranks (gloo) even when GPUs are visible")
        cmd.add_argument("--timeout", type=float, help="kill every rank after this many seconds")
        cmd.add_argument("--verbose", action="store_true", help="show the libraries' warnings and loading bars")
    tiny = sub.add_parser("make-tiny", help="write a tiny checkpoint and a text file to train on")
    tiny.add_argument("directory")
    tiny.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    tiny.add_argument("--lines", type=int, default=2000, help="lines of text (default 2000)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny)
    export = sub.add_parser("export", help="write HF safetensors from an accelerator.save_state checkpoint")
    export.add_argument("checkpoint", help="directory written by accelerator.save_state under nd_parallel")
    export.add_argument("output", help="directory for config.json + *.safetensors (from_pretrained loads it)")
    export.add_argument("--max-shard-size", default="10GB", help="largest safetensors file (default 10GB)")
    export.set_defaults(func=cmd_export)
    from .plan import add_parser as add_plan_parser

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
