"""What the benchmark scripts share: the command line, the self-launch, the ranks' result, the report tail.

Every ``bench_*.py`` is one script in two roles. Run by the user it is the parent: it prepares a model, starts
itself as N gloo ranks through torchrun and prints what they measured. Started by torchrun with ``--worker
--result FILE`` it is a rank: it measures, and rank 0 writes the result to FILE as JSON for the parent to read.
``run`` picks the role; ``launch_self`` starts the ranks; ``gather`` and ``write_result`` hand the numbers back.

The scripts import this file as ``_common``: Python puts a script's own folder first on sys.path, both when the
user runs ``python benchmarks/bench_x.py`` and when torchrun starts that file as the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

MB = 2**20


# ------------------------------------------------------------------------------------------------ host memory
def rss_status() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler(threading.Thread):
    """Highest RssAnon and RssFile seen, sampled every ``interval`` seconds (ru_maxrss has only the total).
    ``stop.set()`` then ``sample()`` takes the last reading."""

    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.anon, self.file, self.stop = interval, 0, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def sample(self):
        s = rss_status()
        self.anon, self.file = max(self.anon, s.get("RssAnon", 0)), max(self.file, s.get("RssFile", 0))


# --------------------------------------------------------------------------------------------- command line
def parser(doc: str) -> argparse.ArgumentParser:
    """The script's docstring as its --help, usage lines included (they are the commands docs/benchmarks.md
    quotes)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def flags(p: argparse.ArgumentParser, **specs) -> None:
    """``--name`` per keyword, underscores written as dashes, typed by its default; ``(default, help)`` adds a
    help text, and a default of False makes a switch. One call per script keeps the many numeric flags short."""
    for name, spec in specs.items():
        default, text = spec if isinstance(spec, tuple) else (spec, None)
        flag = "--" + name.replace("_", "-")
        if default is False:
            p.add_argument(flag, action="store_true", help=text)
        else:
            p.add_argument(flag, type=type(default), default=default, help=text)


def parse(p: argparse.ArgumentParser, argv: list[str] | None, *, quick: dict | None = None,
          quick_help: str | None = None, json_help: str | None = None, timeout: float | None = None,
          internal: tuple[str, ...] = (), worker: bool = True) -> argparse.Namespace:
    """Add the flags the benchmarks have in common, parse ``argv`` and apply ``--quick``.

    quick: the smoke run's settings. They are applied in the ranks as well, which matters for the scripts that
    forward their whole command line (``--quick`` included) to the ranks.
    json_help: add ``--json FILE`` with this help. timeout: add ``--timeout`` (seconds one launch may take).
    internal: hidden flags the parent passes to its ranks; ``--worker`` and ``--result`` too unless worker=False.
    """
    p.add_argument("--quick", action="store_true", help=quick_help)
    if json_help:
        p.add_argument("--json", help=json_help)
    if timeout is not None:
        p.add_argument("--timeout", type=float, default=timeout, help=f"wall-clock limit of a launch, s [{timeout:g}]")
    if worker:
        p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
        internal = ("--result", *internal)
    for flag in internal:
        p.add_argument(flag, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(quick or {})
    return args


def run(parse_args, worker, parent) -> int:
    """The entry point: as a rank (``--worker``) measure; as the parent, ``parent(args, argv)`` launches and
    reports. The parent gets the command line as typed, for the scripts that hand it to their ranks unchanged."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizers' fork warning, in every process
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return parent(args, argv) or 0


# --------------------------------------------------------------------------------------------- self-launch
def launch_self(script: str, world: int, args: list[str], *, timeout: float, env: dict | None = None,
                capture: bool = False):
    """Start ``script`` as ``world`` ranks with ``args`` (``--worker --result FILE`` appended) and return the
    JSON rank 0 wrote. Offline: the ranks load the checkpoint the parent saved, never the Hub. ``capture`` keeps
    the ranks' output out of the terminal unless the launch fails (it is then in the exception)."""
    from nd_parallel.testing.launch import launch_for_result

    return launch_for_result(str(Path(script).resolve()), world, list(args), timeout=timeout,
                             env={"HF_HUB_OFFLINE": "1", **(env or {})}, capture=capture)


def launch_timed(script: str, world: int, args: list[str], **kwargs) -> tuple[dict, str]:
    """``launch_self`` and how long it took, as the "launch took N s" lines print it: the ranks' start-up is
    most of a quick run, so the reader sees what the report's numbers leave out."""
    start = time.perf_counter()
    result = launch_self(script, world, args, **kwargs)
    return result, f"{time.perf_counter() - start:.0f} s"


def gather(obj) -> list:
    """Every rank's ``obj`` in rank order, on every rank; ``[obj]`` when there is no group of several."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_result(args: argparse.Namespace, data) -> None:
    """Rank 0 hands ``data`` to the parent (``launch_self`` reads the file); the other ranks write nothing."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(data))


# --------------------------------------------------------------------------------------------- set-up
def save_llama(directory: str | Path, hidden: int, layers: int, heads: int, intermediate: int | None = None,
               **overrides) -> str:
    """A random untied Llama checkpoint (kv heads half the heads, intermediate 4 x hidden unless given) in
    ``directory``; its path."""
    from nd_parallel.testing.models import save_tiny_model

    return str(save_tiny_model("llama", Path(directory), hidden_size=hidden, num_hidden_layers=layers,
                               intermediate_size=intermediate or 4 * hidden, num_attention_heads=heads,
                               num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                               tie_word_embeddings=False, **overrides))


def quiet_transformers() -> None:
    """No per-rank warnings and progress bars from transformers: they repeat on every rank and say nothing about
    speed."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def read(path: str) -> str:
    """A file's text, or "" where it cannot be read (/proc entries off Linux)."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: how busy the shared machine was around a measurement."""
    return " ".join(read("/proc/loadavg").split()[:3]) or "n/a"


def machine() -> dict:
    """Library versions and the CPU, printed beside the numbers so that a reader can tell runs apart."""
    import accelerate
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), "unknown")
    return {"torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "cpu": cpu}


# --------------------------------------------------------------------------------------------- report tail
def md_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(head: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines: header, rule, one line per row of already formatted cells. Markdown because
    docs/benchmarks.md pastes these tables as they are printed."""
    return [md_row(head), "|" + "---|" * len(head), *(md_row(r) for r in rows)]


def write_json(path: str | None, data) -> None:
    """``--json FILE``: the raw numbers behind the printed report (nothing without the flag)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1))


def print_report(title: str, head: list[str], rows: list[list], raw) -> None:
    """A benchmark's result: its title with the machine's load, the markdown table, and the raw numbers as JSON."""
    print(f"\n{title}; load {loadavg()}\n")
    print("\n".join(md_table(head, rows)))
    print("\nraw:", json.dumps(raw))
