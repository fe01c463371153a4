"""Peak RSS per rank of memory-efficient loading vs a plain from_pretrained on every rank, at 2 and 4 ranks.

The checkpoint is generated once from a config (Llama, untied, fp32, about 450 MB, saved in ~100 MB files with
an index) and every (layout, path) pair runs in its own fresh torchrun launch, so a process's peak RSS
(``ru_maxrss``) is that of one load only. Per rank the script records, around "load + accelerator.prepare":

    before      RSS once torch, transformers, the Accelerator and the mesh are up (the process's floor)
    peak        ru_maxrss at the end of prepare: the highest RSS the process ever had
    load peak   peak - before: what loading added at its worst
    after       RSS after prepare (the steady state training starts from)
    own         bytes of the parameters this rank holds after prepare (its share of the model)
    anon/file   how far anonymous / file-backed RSS rose above "before", as seen by a 2 ms sampler thread (mapped
                checkpoint pages are file-backed: reclaimable, but counted in RSS while mapped). Sampled: a
                lower bound that can miss short peaks when the machine is busy; "peak" is exact.

    python benchmarks/bench_loading.py                  # fsdp2, pp2 on 2 ranks; fsdp4, fsdp2_tp2 on 4 ranks
    python benchmarks/bench_loading.py --quick          # smoke run: a ~15 MB model
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

# name -> (ranks, ParallelismConfig kwargs, ranks the weights are split over)
LAYOUTS = {
    "fsdp2": (2, dict(dp_shard_size=2), 2),
    "pp2": (2, dict(pp_size=2), 2),
    "fsdp4": (4, dict(dp_shard_size=4), 4),
    "fsdp2_tp2": (4, dict(dp_shard_size=2, tp_size=2), 4),
}
MB = 2**20


def _status() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler(threading.Thread):
    """Highest RssAnon and RssFile seen, sampled every ``interval`` seconds (ru_maxrss has only the total)."""

    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.anon, self.file, self.stop = interval, 0, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def sample(self):
        s = _status()
        self.anon, self.file = max(self.anon, s.get("RssAnon", 0)), max(self.file, s.get("RssFile", 0))


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor
    from transformers.utils import logging as hf_logging

    from nd_parallel import NDParallelPlugin, ParallelismConfig

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    accelerator = Accelerator()
    plugin = NDParallelPlugin(ParallelismConfig(**LAYOUTS[args.layout][1])).attach(accelerator)
    plugin.mesh  # built now (a collective), so that its cost is not counted as loading
    dist.barrier()
    floor, peak_before = _status(), _maxrss()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    model = plugin.from_pretrained(args.model_dir, memory_efficient=args.path == "efficient")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # no state yet: it allocates nothing
    model, opt = accelerator.prepare(model, opt)
    seconds = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    sampler.sample()  # the end state too: on a busy machine the thread may not have run since the last read
    seen, own = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            t = p.to_local() if isinstance(p, DTensor) else p
            own += t.numel() * t.element_size()
    mine = dict(before=floor["VmRSS"], before_anon=floor["RssAnon"], before_file=floor["RssFile"],
                peak_before=peak_before, peak=_maxrss(), after=_status()["VmRSS"], own=own, anon=sampler.anon,
                file=sampler.file, seconds=seconds)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


def make_checkpoint(args, directory: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=args.vocab, hidden_size=args.hidden,
                                  intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                  num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                                  head_dim=args.hidden // args.heads, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, max_shard_size=args.shard_size)
    files = sorted(directory.glob("*.safetensors"))
    return {"bytes": sum(f.stat().st_size for f in files), "files": len(files),
            "params": sum(p.numel() for p in model.parameters())}


def report(results: dict, model: dict) -> str:
    size = model["bytes"] / MB
    lines = [f"model: Llama, {model['params'] / 1e6:.1f} M parameters, fp32, {size:.0f} MiB in {model['files']} "
             "safetensors files", "",
             "| layout | ranks | path | before (MiB) | peak (MiB) | load peak = peak - before (MiB) | "
             "load peak / model | load peak / (model / shards) | after (MiB) | own params (MiB) | "
             "anon / file rise (MiB) | load+prepare (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (layout, path), ranks in results.items():
        world, _, shards = LAYOUTS[layout]
        worst = max(ranks, key=lambda r: r["peak"] - r["before"])
        rise = [(r["peak"] - r["before"]) / MB for r in ranks]
        lines.append(
            f"| {layout} | {world} | {path} | {worst['before'] / MB:.0f} | {worst['peak'] / MB:.0f} | "
            f"{' / '.join(f'{x:.0f}' for x in rise)} | {max(rise) / size:.2f} | {max(rise) / (size / shards):.2f} | "
            f"{worst['after'] / MB:.0f} | {max(r['own'] for r in ranks) / MB:.0f} | "
            f"{(worst['anon'] - worst['before_anon']) / MB:.0f} / {(worst['file'] - worst['before_file']) / MB:.0f} | "
            f"{max(r['seconds'] for r in ranks):.1f} |")
    lines.append("")
    for layout in dict.fromkeys(k[0] for k in results):
        if (layout, "efficient") in results and (layout, "plain") in results:
            e = max(r["peak"] - r["before"] for r in results[layout, "efficient"])
            p = max(r["peak"] - r["before"] for r in results[layout, "plain"])
            ep = max(r["peak"] for r in results[layout, "efficient"])
            pp = max(r["peak"] for r in results[layout, "plain"])
            lines.append(f"{layout}: load peak efficient / plain = {e / p:.2f}; whole-process peak {ep / pp:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {list(LAYOUTS)}")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--shard-size", default="100MB", help="max_shard_size of save_pretrained [100MB]")
    p.add_argument("--quick", action="store_true", help="a ~15 MB model in 3 files")
    p.add_argument("--json", help="also write the raw per-rank numbers to this file")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.vocab, args.hidden, args.intermediate, args.shard_size = 4096, 256, 1024, "6MB"
    from nd_parallel.testing.launch import launch_for_result

    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_loading_") as tmp:
        model = make_checkpoint(args, Path(tmp) / "model")
        print(f"[bench] checkpoint: {model['bytes'] / MB:.0f} MiB in {model['files']} files", flush=True)
        for layout in layouts:
            for path in ("efficient", "plain"):
                start = time.perf_counter()
                results[layout, path] = launch_for_result(
                    str(Path(__file__).resolve()), LAYOUTS[layout][0],
                    ["--layout", layout, "--path", path, "--model-dir", str(Path(tmp) / "model")],
                    timeout=args.timeout, env={"HF_HUB_OFFLINE": "1"})
                print(f"[bench] {layout} {path}: {time.perf_counter() - start:.0f} s", flush=True)
    print()
    print(report(results, model))
    if args.json:
        runs = {f"{layout}/{path}": ranks for (layout, path), ranks in results.items()}
        Path(args.json).write_text(json.dumps({"model": model, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
