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

import resource
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch
from _common import MB, PeakSampler
from _common import rss_status as _status

# name -> (ranks, ParallelismConfig kwargs, ranks the weights are split over)
LAYOUTS = {
    "fsdp2": (2, dict(dp_shard_size=2), 2),
    "pp2": (2, dict(pp_size=2), 2),
    "fsdp4": (4, dict(dp_shard_size=4), 4),
    "fsdp2_tp2": (4, dict(dp_shard_size=2, tp_size=2), 4),
}


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    from nd_parallel import NDParallelPlugin, ParallelismConfig

    _common.quiet_transformers()
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
    _common.write_result(args, _common.gather(mine))
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


HEAD = ["layout", "ranks", "path", "before (MiB)", "peak (MiB)", "load peak = peak - before (MiB)", "load peak / model",
        "load peak / (model / shards)", "after (MiB)", "own params (MiB)", "anon / file rise (MiB)",
        "load+prepare (s)"]


def report(results: dict, model: dict) -> str:
    size = model["bytes"] / MB
    rows = []
    for (layout, path), ranks in results.items():
        world, _, shards = LAYOUTS[layout]
        worst = max(ranks, key=lambda r: r["peak"] - r["before"])
        rise = [(r["peak"] - r["before"]) / MB for r in ranks]
        rows.append([layout, world, path, f"{worst['before'] / MB:.0f}", f"{worst['peak'] / MB:.0f}",
                     " / ".join(f"{x:.0f}" for x in rise), f"{max(rise) / size:.2f}",
                     f"{max(rise) / (size / shards):.2f}", f"{worst['after'] / MB:.0f}",
                     f"{max(r['own'] for r in ranks) / MB:.0f}",
                     (f"{(worst['anon'] - worst['before_anon']) / MB:.0f} / "
                      f"{(worst['file'] - worst['before_file']) / MB:.0f}"), f"{max(r['seconds'] for r in ranks):.1f}"])
    lines = [f"model: Llama, {model['params'] / 1e6:.1f} M parameters, fp32, {size:.0f} MiB in {model['files']} "
             "safetensors files", "", *_common.md_table(HEAD, rows), ""]
    for layout in dict.fromkeys(k[0] for k in results):
        if (layout, "efficient") in results and (layout, "plain") in results:
            e = max(r["peak"] - r["before"] for r in results[layout, "efficient"])
            p = max(r["peak"] - r["before"] for r in results[layout, "plain"])
            ep = max(r["peak"] for r in results[layout, "efficient"])
            pp = max(r["peak"] for r in results[layout, "plain"])
            lines.append(f"{layout}: load peak efficient / plain = {e / p:.2f}; whole-process peak {ep / pp:.2f}")
    return "\n".join(lines)


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, layouts=(",".join(LAYOUTS), f"comma-separated, from {list(LAYOUTS)}"), vocab=32000, hidden=1024,
                  intermediate=2816, layers=4, heads=16,
                  shard_size=("100MB", "max_shard_size of save_pretrained [100MB]"))
    args = _common.parse(p, argv, quick={"vocab": 4096, "hidden": 256, "intermediate": 1024, "shard_size": "6MB"},
                         quick_help="a ~15 MB model in 3 files",
                         json_help="also write the raw per-rank numbers to this file", timeout=900,
                         internal=("--layout", "--path", "--model-dir"))
    unknown = [name for name in args.layouts.split(",") if name not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    return args


def parent(args, argv) -> None:
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_loading_") as tmp:
        model = make_checkpoint(args, Path(tmp) / "model")
        print(f"[bench] checkpoint: {model['bytes'] / MB:.0f} MiB in {model['files']} files", flush=True)
        for layout in args.layouts.split(","):
            for path in ("efficient", "plain"):
                forwarded = ["--layout", layout, "--path", path, "--model-dir", str(Path(tmp) / "model")]
                results[layout, path], took = _common.launch_timed(__file__, LAYOUTS[layout][0], forwarded,
                                                                   timeout=args.timeout)
                print(f"[bench] {layout} {path}: {took}", flush=True)
    print()
    print(report(results, model))
    runs = {f"{layout}/{path}": ranks for (layout, path), ranks in results.items()}
    _common.write_json(args.json, {"model": model, "runs": runs})


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
