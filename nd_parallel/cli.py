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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import PARALLEL_KEYS, ConfigError, ParallelismConfig
from .train import DatasetSpec, dataset_specs, suggest

_TOKEN = re.compile(r"(ddp|fsdp|hsdp|tp|cp|pp)(\d*)(?:x(\d+))?")
_SIZE_OF = {"ddp": "dp_replicate_size", "fsdp": "dp_shard_size", "tp": "tp_size", "cp": "cp_size", "pp": "pp_size"}
TOLERANCE = 1e-5  # the parity matrix's tolerances (ARCHITECTURE.md), quoted next to the demo's numbers
SCHEDULERS = ("constant", "linear", "cosine")


# ---------------------------------------------------------------------------------------------- train YAML
@dataclass(kw_only=True)
class TrainConfig:
    """A training run read from YAML. Precedence of the layout keys: CLI > YAML > env > defaults."""

    base_model: str
    """Local directory of a Hugging Face causal-LM checkpoint. Required."""
    datasets: list[DatasetSpec]
    """Text sources; `dataset_path: FILE` is shorthand for one completion source. Required."""
    sequence_len: int = 512
    """Tokens per sample; documents are packed into samples of at most this length. Default 512; >= 2."""
    micro_batch_size: int = 1
    """Samples per rank per forward pass. Default 1."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Default 1."""
    max_steps: int | None = None
    """Optimizer steps. Default None = one pass over the data."""
    learning_rate: float = 1e-4
    """AdamW peak learning rate. Default 1e-4."""
    weight_decay: float = 0.0
    """AdamW weight decay. Default 0."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this. Default 1.0."""
    lr_scheduler: str = "cosine"
    """"constant", "linear" or "cosine" (default), after `warmup_steps` linear warm-up steps."""
    warmup_steps: int = 0
    """Linear warm-up steps. Default 0."""
    seed: int = 42
    """Seed set on every rank before the model is loaded. Default 42."""
    bf16: bool | str = False
    """bf16 mixed precision (fp32 master weights, bf16 compute, fp32 reductions): true, false (default) or "auto"
    (bf16 where the GPUs support it, fp32 on CPU ranks, where bf16 matmuls are slower than fp32)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward (activation_checkpointing: full). Default false."""
    output_dir: str = "outputs/nd-parallel"
    """Where the final HF checkpoint and train_log.jsonl are written. Default outputs/nd-parallel."""
    parallel: ParallelismConfig = field(default_factory=ParallelismConfig)
    """The layout: built from the parallel keys (PARALLEL_KEYS) of the same file."""
    layout: str | None = None
    """"auto": the planner's top layout for the ranks launched (plan_cli.auto_train_layout). Default None."""
    lr_scaling: str | None = None
    """"linear" or "sqrt": scale learning_rate from base_batch_size to the global batch. Default None = as given."""
    base_batch_size: int | None = None
    """The global batch learning_rate was tuned at (with lr_scaling). Default None."""


# key -> (type, bound, how a value compares with the bound)
_CHECKS = {"sequence_len": (int, 2, ">="), "micro_batch_size": (int, 1, ">="), "max_steps": (int, 1, ">="),
           "gradient_accumulation_steps": (int, 1, ">="), "warmup_steps": (int, 0, ">="), "seed": (int, 0, ">="),
           "learning_rate": (float, 0, ">"), "weight_decay": (float, 0, ">="), "max_grad_norm": (float, 0, ">"),
           "base_batch_size": (int, 1, ">=")}
TRAIN_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig) if f.name != "parallel") | {"dataset_path"}


def read_yaml_mapping(path: str | os.PathLike) -> dict:
    """The top-level mapping of a YAML file, read with safe_load; errors name the file and the fix."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    try:
        data = yaml.safe_load(text)  # safe_load only: reading a config must never run code
    except yaml.constructor.ConstructorError as err:
        mark = err.problem_mark
        raise ConfigError(f"{path}, line {mark.line + 1}: {err.problem}; only plain YAML values are allowed "
                          "(numbers, strings, lists, mappings): remove the tag") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: malformed YAML: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(data, dict):
        got = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"{path} is {got}; expected a mapping of keys such as 'base_model: path/to/model'")
    return data


def _check_value(path, key: str, value: Any) -> Any:
    kind, bound, op = _CHECKS[key]
    if kind is float and isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    number = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if not number or value < bound or (op == ">" and value == bound):
        raise ConfigError(f"{path}: {key}={value!r} must be {'an integer' if kind is int else 'a number'} "
                          f"{op} {bound}")
    return kind(value)


def load_train_config(path: str | os.PathLike, environ=None) -> TrainConfig:
    """Parse and check a training YAML (no file of the model or data is opened yet)."""
    data = read_yaml_mapping(path)
    for key in data:
        if key not in TRAIN_KEYS and key not in PARALLEL_KEYS:
            raise ConfigError(f"unknown key {key!r} in {path}; {suggest(str(key), TRAIN_KEYS | PARALLEL_KEYS)}")
    if "base_model" not in data:
        raise ConfigError(f"{path}: base_model is required: the local directory of a Hugging Face checkpoint "
                          "(config.json + *.safetensors), e.g. 'base_model: runs/tiny/model'")
    if data.get("layout", "auto") != "auto" or data.get("lr_scaling", "linear") not in ("linear", "sqrt"):
        raise ConfigError(f"{path}: layout={data.get('layout')!r} / lr_scaling={data.get('lr_scaling')!r}; "
                          "write 'layout: auto' (or leave it out) and 'lr_scaling: linear' or 'sqrt'")
    if data.get("layout") == "auto" and set(data) & (PARALLEL_KEYS - {"pp_backend", "cp_backend", "tp_plan"}):
        raise ConfigError(f"{path}: layout: auto chooses the layout, but the file also sets "
                          f"{', '.join(sorted(set(data) & PARALLEL_KEYS))}; remove those keys or 'layout: auto'")
    for key in ("base_model", "output_dir", "lr_scheduler"):
        if key in data and not isinstance(data[key], str):
            raise ConfigError(f"{path}: {key}={data[key]!r} is a {type(data[key]).__name__}; write a string")
    yaml_layout = {k: v for k, v in data.items() if k in PARALLEL_KEYS}
    # One precedence rule (config.py): YAML overrides the PARALLELISM_CONFIG_* variables.
    layout = ParallelismConfig.merge(ParallelismConfig.env_overrides(environ), yaml_layout, source=str(path))
    train = {k: v for k, v in data.items() if k in TRAIN_KEYS}
    specs = dataset_specs(path, train.pop("datasets", None), train.pop("dataset_path", None))
    for key in _CHECKS:
        if train.get(key) is not None:
            train[key] = _check_value(path, key, train[key])
    if train.get("bf16", False) not in (True, False, "auto"):
        raise ConfigError(f"{path}: bf16={train['bf16']!r}; use true, false or auto")
    if not isinstance(train.get("gradient_checkpointing", False), bool):
        raise ConfigError(f"{path}: gradient_checkpointing={train['gradient_checkpointing']!r}; use true or false")
    if train.get("gradient_checkpointing") and layout.activation_checkpointing is None:
        layout = dataclasses.replace(layout, activation_checkpointing="full")
    if train.get("lr_scheduler", "cosine") not in SCHEDULERS:
        raise ConfigError(f"{path}: lr_scheduler={train['lr_scheduler']!r}; use one of {', '.join(SCHEDULERS)}")
    return TrainConfig(**train, datasets=specs, parallel=layout)


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


def choose_ranks(config: ParallelismConfig, nproc: int | None, force_cpu: bool, cpu_fallback: bool):
    """(resolved config, number of ranks, "cuda" or "cpu"). GPUs are used when there are enough of them."""
    import torch

    if _inside_launched_rank():
        return config.resolve(int(os.environ["WORLD_SIZE"])), int(os.environ["WORLD_SIZE"]), "launched"
    gpus = 0 if force_cpu else torch.cuda.device_count()
    if nproc is None and config.dp_shard_size == -1:  # "the ranks left over": every GPU, or 2-way on CPU
        others = math.prod(size for dim, size in config.sizes.items() if dim != "dp_shard")
        if not (gpus and gpus % others == 0) and not cpu_fallback:
            raise ConfigError("dp_shard_size=-1 takes the ranks left over, so give the number of ranks: --nproc N")
        nproc = gpus if gpus and gpus % others == 0 else 2 * others
    nproc = nproc if nproc is not None else config.world_size
    config = config.resolve(nproc)
    if gpus >= nproc:
        return config, nproc, "cuda"
    if gpus and not cpu_fallback:
        raise ConfigError(f"the layout needs {nproc} ranks but {gpus} GPU(s) are visible; pass --cpu to train on "
                          "CPU ranks, or use a layout with fewer ranks")
    if gpus:
        print(f"nd-parallel: {nproc} ranks do not fit {gpus} GPU(s); running on CPU ranks (gloo)")
    return config, nproc, "cpu"


def _run_job(job: dict, nproc: int, device: str, tmp: Path, timeout: float) -> dict | None:
    """Every rank's results (rank 0's file), or None on the other ranks of an outer launcher."""
    import json

    import torch

    from . import train
    from .launch import launch

    if device == "launched":
        return train.run_rank(job)
    job["results"] = str(tmp / "results.pt")
    (tmp / "job.json").write_text(json.dumps(job))
    env = {}
    if job.get("quiet"):
        env.update(TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONWARNINGS="ignore")
    if device == "cpu" and torch.cuda.is_available():
        env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="true")
    launch(train.__file__, nproc, [str(tmp / "job.json")], timeout=timeout, env=env)
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

    from .parity import Recipe, RunResult, compare, train_reference
    from .toy import make_samples, save_tiny_model
    from .train import checkpoint_numel

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


def cmd_train(args) -> int:
    import torch

    from .train import build_samples, checkpoint_numel

    cfg = load_train_config(args.config)
    cfg.base_model = os.path.abspath(cfg.base_model)
    cfg.output_dir = os.path.abspath(cfg.output_dir)
    if not (Path(cfg.base_model) / "config.json").is_file():
        raise ConfigError(f"{args.config}: base_model {cfg.base_model!r} is not a Hugging Face checkpoint "
                          "directory (no config.json); create a tiny one with `nd-parallel make-tiny DIR`")
    if cfg.parallel.pp_size > 1 and cfg.parallel.pp_backend == "deepspeed" and cfg.gradient_accumulation_steps > 1:
        # DeepSpeed all-reduces a tied weight's whole gradient at the end of every schedule run, so a second
        # accumulated run would count the first one's tied gradient twice.
        raise ConfigError(f"{args.config}: gradient_accumulation_steps={cfg.gradient_accumulation_steps} with "
                          "pp_backend='deepspeed': the pipeline already splits each step into micro-batches; set "
                          "gradient_accumulation_steps: 1 and raise pp_microbatches, or use pp_backend='torch'")
    if cfg.layout == "auto":  # the planner's top plan for the ranks launched (plan_cli.py)
        from .plan_cli import auto_train_layout

        nproc_auto = int(os.environ["WORLD_SIZE"]) if _inside_launched_rank() else args.nproc
        use_cuda = not args.cpu and torch.cuda.is_available()
        cfg.parallel, _ = auto_train_layout(cfg, args.config, nproc_auto, "cuda" if use_cuda else "cpu")
    config, nproc, device = choose_ranks(cfg.parallel, args.nproc, args.cpu, cpu_fallback=False)
    if cfg.lr_scaling:
        from .plan_cli import scaled_learning_rate

        cfg.learning_rate = scaled_learning_rate(
            cfg, args.config, cfg.micro_batch_size * cfg.gradient_accumulation_steps * config.dp_size)
    samples, how = build_samples(cfg.base_model, cfg.datasets, cfg.sequence_len)
    per_micro = cfg.micro_batch_size * config.dp_size
    if len(samples) < per_micro:
        raise ConfigError(f"{args.config}: {len(samples)} samples, but one micro-batch over {config.dp_size} "
                          f"data-parallel ranks needs micro_batch_size x {config.dp_size} = {per_micro}")
    steps = cfg.max_steps or max(1, len(samples) // (per_micro * cfg.gradient_accumulation_steps))
    if not _inside_launched_rank() or int(os.environ.get("RANK", "0")) == 0:
        print(f"nd-parallel train: {len(samples)} samples of {cfg.sequence_len} tokens ({how}); {steps} steps of "
              f"{cfg.gradient_accumulation_steps} x {per_micro} samples on {config.describe()}")
    train = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("parallel", "datasets")}
    with tempfile.TemporaryDirectory(prefix="nd-parallel-train-") as tmp:
        tmp = Path(tmp)
        if device != "launched":
            torch.save(samples, tmp / "samples.pt")
        job = {"kind": "train", "name": Path(args.config).stem, "layout": config.to_dict(), "steps": steps,
               "samples": samples if device == "launched" else str(tmp / "samples.pt"),
               "train": {**train, "max_steps": steps}, "quiet": not args.verbose}
        start = time.perf_counter()
        results = _run_job(job, nproc, device, tmp, args.timeout)
    if results is None:
        return 0
    rows = [("layout", f"{results['layout']}, {nproc} {results['ranks'][0]['device'].split(':')[0].upper()} ranks"),
            (f"loss per step ({steps})", _loss_lines(results["losses"])),
            ("params + AdamW per rank", _memory_lines(results["ranks"], 3 * 4 * checkpoint_numel(cfg.base_model))),
            ("saved", f"{cfg.output_dir} (config.json, model.safetensors, train_log.jsonl)"),
            ("time", f"{time.perf_counter() - start:.1f} s")]
    print(_table(f"nd-parallel train: {args.config}", rows))
    return 0


def cmd_make_tiny(args) -> int:
    import json

    from .toy import make_text, save_tiny_model

    root = Path(args.directory)
    model = save_tiny_model(args.family, root / "model", seed=args.seed)
    lines = make_text(args.lines, seed=args.seed)
    (root / "data.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines), encoding="utf-8")
    print(f"wrote a tiny {args.family} checkpoint to {model} (no tokenizer: `train` uses byte-level ids)\n"
          f"and {args.lines} lines of text to {root / 'data.txt'} and {root / 'data.jsonl'}")
    return 0


def cmd_export(args) -> int:
    """HF safetensors from a save_state checkpoint, offline: one process, one tensor in memory at a time."""
    from .checkpoint import CheckpointError, export_checkpoint

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
    from .toy import FAMILIES

    parser = argparse.ArgumentParser(prog="nd-parallel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny model under a layout and compare it with one process")
    demo.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    demo.add_argument("--layout", default="fsdp2_tp2", help="e.g. ddp2, fsdp2, hsdp2x2, tp2, fsdp2_tp2, hsdp2x2_tp2")
    demo.add_argument("--family", default="llama", choices=sorted(FAMILIES), help="tiny model family (llama)")
    demo.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default 32)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    train = sub.add_parser("train", help="train from an Axolotl-style YAML file")
    train.add_argument("config", help="YAML with base_model, datasets, ... and the parallel sizes")
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
    from .plan_cli import add_parser as add_plan_parser

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
