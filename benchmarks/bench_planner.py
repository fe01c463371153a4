"""Validate the planner: predicted vs measured peak memory per rank and step time, on 4 CPU ranks (gloo, fp32).

For two model shapes (a Llama with untied embeddings, a Qwen3 with per-head q/k norms and tied embeddings) and
17 layouts each (FSDP, DDP, HSDP, TP, CP, PP with 1F1B and GPipe, full activation checkpointing, LoRA; the chunked
loss, vocabulary-parallel under TP, and SP, with HF's loss and TP without SP beside), one launch of 4 ranks trains
every layout for a few steps and measures:
- the peak of live tensor memory per rank over one training step (forward, backward, AdamW step), allocator
  level: a TorchDispatchMode that follows every storage an op creates until it is freed, plus the parameters,
  gradients and optimizer state alive when the step starts (the count torch.distributed._tools.mem_tracker.MemTracker keeps);
- the median step time over `--steps` steps after a warm-up (without the tracker).
Before the layouts, every rank measures this machine's rates at once (matmul FLOP/s; elementwise bytes/s of
out-of-place ops; gloo all-reduce latency and bandwidth; send/recv latency; host seconds per aten op and per DTensor
op on 8-element tensors; how much faster one rank computes while the others wait); the planner's Cluster gets
those, nothing else is fitted. The op counts the time model multiplies them with come from the model (ops.py).

Two sets of shapes. SHAPES are the ones the memory model's fixes were found on: its error there is in-sample.
HELD_OUT (``--held-out``) are shapes nobody looked at while building the model: other families (Mistral, Gemma:
tied embeddings, a scaled embedding, GeGLU), other widths, depths, head counts and sequence lengths. Their error is
the one to expect on a new model. The report gives both, never pooled.

No other estimator is printed beside ours: accelerate's `estimate-memory` gives one whole-model figure without
layout, activations or logits, and DeepSpeed's ZeRO-3 estimator model states only; neither predicts what is
measured here (a rank's peak of live tensors in a training step), so a ratio to it would not compare like with like.

    python benchmarks/bench_planner.py                # in-sample: both shapes, 17 layouts each (~6 min)
    python benchmarks/bench_planner.py --held-out     # out-of-sample: the HELD_OUT shapes, same layouts
    python benchmarks/bench_planner.py --quick        # 4 layouts of the first shape
    python benchmarks/bench_planner.py --json runs/bench_planner.json
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import _common
import torch

WORLD = 4
SHAPES = {  # name -> (family, overrides)
    "llama-h256-L4-v4096": ("llama", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                          vocab_size=4096, tie_word_embeddings=False)),
    "qwen3-h192-L4-v8192-tied": ("qwen3", dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                                               num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                                               vocab_size=8192, tie_word_embeddings=True)),
}
# Out of sample (docstring): fixed before their first run, never used to change the model (Gemma's TP/PP4 are refused).
HELD_OUT = {
    "mistral-h320-L6-s384": ("mistral", dict(hidden_size=320, intermediate_size=864, num_hidden_layers=6,
                                             num_attention_heads=10, num_key_value_heads=2, head_dim=32,
                                             vocab_size=6000, tie_word_embeddings=False), 384),
    "gemma-h160-L3-s512-tied": ("gemma", dict(hidden_size=160, intermediate_size=640, num_hidden_layers=3,
                                              num_attention_heads=4, num_key_value_heads=1, head_dim=40,
                                              vocab_size=5000, tie_word_embeddings=True), 512),
}
# name -> (ParallelismConfig kwargs, extras: ckpt "full", lora rank)
LAYOUTS = {
    "fsdp4": (dict(dp_shard_size=4), {}),
    "ddp4": (dict(dp_replicate_size=4), {}),
    "hsdp2x2": (dict(dp_replicate_size=2, dp_shard_size=2), {}),
    "fsdp2_tp2": (dict(dp_shard_size=2, tp_size=2), {}),
    "ddp2_tp2": (dict(dp_replicate_size=2, tp_size=2), {}),
    "cp2_fsdp2": (dict(cp_size=2, dp_shard_size=2), {}),
    "cp4": (dict(cp_size=4), {}),
    "tp2_cp2": (dict(tp_size=2, cp_size=2), {}),
    "pp2_fsdp2_1f1b": (dict(pp_size=2, dp_shard_size=2, pp_microbatches=2), {}),
    "pp4_1f1b": (dict(pp_size=4, pp_microbatches=4), {}),
    "pp2_tp2_gpipe": (dict(pp_size=2, tp_size=2, pp_schedule="gpipe", pp_microbatches=2), {}),
    "fsdp4_full_ckpt": (dict(dp_shard_size=4, activation_checkpointing="full"), {}),
    "cp2_fsdp2_full_ckpt": (dict(cp_size=2, dp_shard_size=2, activation_checkpointing="full"), {}),
    "fsdp4_lora": (dict(dp_shard_size=4), {"lora": 8}),
    # the rows above run the defaults (chunked loss, vocabulary-parallel under TP; SP under TP); these the other side
    "fsdp4_hf_loss": (dict(dp_shard_size=4, loss_chunk_size=0), {}),
    "fsdp2_tp2_hf_loss": (dict(dp_shard_size=2, tp_size=2, loss_chunk_size=0), {}),
    "fsdp2_tp2_no_sp": (dict(dp_shard_size=2, tp_size=2, sequence_parallel=False), {}),
}
# Added once bf16 mixed precision and selective checkpointing landed (run them with --layouts; see docs).
EXTRA = {
    "fsdp4_selective_ckpt": (dict(dp_shard_size=4, activation_checkpointing="selective"), {}),
    "fsdp4_bf16": (dict(dp_shard_size=4), {"bf16": True}),
    "fsdp2_tp2_bf16": (dict(dp_shard_size=2, tp_size=2), {"bf16": True}),
    "pp2_fsdp2_bf16_full_ckpt": (dict(pp_size=2, dp_shard_size=2, pp_microbatches=2,
                                      activation_checkpointing="full"), {"bf16": True}),
}
LAYOUTS.update(EXTRA)
QUICK = ("fsdp4", "fsdp2_tp2", "cp2_fsdp2", "pp2_fsdp2_1f1b")


# ------------------------------------------------------------------------------------------------ ranks
def _rates(dist) -> dict:
    """This machine's rates with every rank busy at once (the ranks share the cores)."""
    def timed(fn, n=5):
        fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        dist.barrier()
        return (time.perf_counter() - start) / n

    a, b = torch.randn(1024, 256), torch.randn(256, 688)
    flops = 2 * 1024 * 256 * 688 / timed(lambda: a @ b, 20)
    # alone: rank 0 multiplies while the others wait in a barrier (a pipeline bubble: idle ranks leave the shared
    # cores to the busy one)
    start = time.perf_counter()
    if dist.get_rank() == 0:
        for _ in range(20):
            a @ b
    alone = time.perf_counter() - start
    dist.barrier()
    flops_alone = 2 * 1024 * 256 * 688 * 20 / alone
    x = torch.randn(4 * 2**20)
    # elementwise as a step runs it: out of place (a fresh output each time), a mix of a multiply, an activation
    # and an exponential; read + write per element
    mem_bw = 3 * 2 * x.numel() * 4 / timed(lambda: (x * 1.5, torch.nn.functional.silu(x), torch.exp(x)), 5)
    small, big = torch.zeros(256), torch.zeros(2**20)
    latency = timed(lambda: dist.all_reduce(small), 20)
    t_big = timed(lambda: dist.all_reduce(big), 5)
    n = dist.get_world_size()
    bw = 2 * (n - 1) / n * big.numel() * 4 / max(t_big - latency, 1e-9)
    op_s, dtensor_op_s = _op_rates(timed)
    p2p = _p2p_latency(dist, timed)
    out = torch.tensor([flops, mem_bw, latency, bw, op_s, dtensor_op_s, p2p,
                        flops_alone if dist.get_rank() == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(out)  # every rank uses the same (mean) rates
    flops, mem_bw, latency, bw, op_s, dtensor_op_s, p2p, flops_alone = (out / n).tolist()
    return {"flops": flops, "mem_bw": mem_bw, "latency": latency, "bandwidth": bw, "op_s": op_s,
            "dtensor_op_s": dtensor_op_s, "p2p_latency": p2p, "idle_speedup": max(1.0, flops_alone * n / flops)}


def _op_rates(timed) -> tuple[float, float]:
    """Seconds per aten op on an 8-element tensor (dispatch cost, no arithmetic to speak of), averaged over a
    chain's forward (issued from Python, recording autograd) and its backward (issued by the autograd engine) the
    way a training step mixes them; and the same per op on a DTensor (sharding propagation on top)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from nd_parallel.planner.ops import _Count

    x = torch.zeros(8, requires_grad=True)

    def chain(t):
        for _ in range(50):
            t = t * 1.5
        return t.sum()

    counted = _Count()
    with counted:  # the ops one forward + backward of the chain dispatches
        chain(x).backward()
    plain = timed(lambda: chain(x).backward(), 10) / counted.n
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    d = distribute_tensor(torch.zeros(8), mesh, [Replicate()]).requires_grad_()  # Replicate: no communication
    dtensor = timed(lambda: chain(d).backward(), 3) / counted.n
    return plain, dtensor


def _p2p_latency(dist, timed) -> float:
    """Seconds per send/recv of an 8-element tensor between rank pairs (0<->1, 2<->3): a pipeline hop, a ring step."""
    rank, small = dist.get_rank(), torch.zeros(8)
    peer = rank ^ 1

    def hop():
        if rank % 2 == 0:
            dist.send(small, peer)
            dist.recv(small, peer)
        else:
            dist.recv(small, peer)
            dist.send(small, peer)
    return timed(hop, 20) / 2


def _measure(args, model_dir: str, name: str, seq: int) -> dict:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.planner.measure import LiveTensorBytes, state_tensors

    kwargs, extra = LAYOUTS[name]
    AcceleratorState._reset_state()  # the precision is fixed per AcceleratorState; layouts differ in it
    accelerator = Accelerator(mixed_precision="bf16" if extra.get("bf16") else "no")
    plugin = NDParallelPlugin(ParallelismConfig(**kwargs)).attach(accelerator)
    dp = plugin.config.dp_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if extra.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=extra["lora"], target_modules="all-linear", lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, opt = accelerator.prepare(model, opt)
    ids = torch.randint(1, model.config.vocab_size if hasattr(model, "config") else 256,
                        (args.global_batch // dp, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}  # full-length rows: no mask, SDPA runs causal

    def step():
        out = model(**batch)  # `out` stays alive through backward, as in a user's loop
        accelerator.backward(out.loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    step()  # creates the AdamW state
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    tracker = LiveTensorBytes(state_tensors(model, opt))
    with tracker:
        step()
    return {"peaks": _common.gather(tracker.peak), "step_s": statistics.median(times), "min_step_s": min(times),
            "times": times}


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator

    Accelerator()  # starts the process group (gloo on CPU), as every layout's own Accelerator() will find it
    torch.set_num_threads(1)
    rates = _rates(dist)
    results = {"rates": rates, "runs": {}}
    seqs = json.loads(args.seqs) if args.seqs else {}
    for shape, model_dir in json.loads(args.models).items():
        for name in args.layouts.split(","):
            key = f"{shape}/{name}"
            try:
                results["runs"][key] = _measure(args, model_dir, name, seqs.get(shape, args.seq))
            except Exception as err:  # one broken layout must not hide the others
                print(f"rank {dist.get_rank()} {key}: {traceback.format_exc()}", file=sys.stderr, flush=True)
                results["runs"][key] = {"error": f"{type(err).__name__}: {err}"[:400]}
            if dist.get_rank() == 0:
                print(f"measured {key}: {results['runs'][key]}", flush=True)
    _common.write_result(args, results)


# ------------------------------------------------------------------------------------------------ parent
def _layout(name: str, args):
    """The planner's Layout for a benchmarked configuration (same batch split as the ranks use)."""
    from nd_parallel.planner import Layout

    kwargs, extra = LAYOUTS[name]
    sizes = {k: kwargs.get(f"{k}_size", 1) for k in ("dp_replicate", "dp_shard", "tp", "cp", "pp")}
    lay = Layout(**sizes)
    per_rank = args.global_batch // lay.dp
    m = kwargs.get("pp_microbatches", 1)
    return Layout(**sizes, micro_batch=per_rank // m, microbatches=m, ep=kwargs.get("ep_size", 1),
                  schedule=kwargs.get("pp_schedule", "1f1b") if lay.pp > 1 else None,
                  checkpointing=kwargs.get("activation_checkpointing") or "none"), extra


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):  # the position of each value in sorted order
        order = sorted(range(len(x)), key=lambda i: x[i])
        return [float(order.index(i)) for i in range(len(x))]
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def report(data: dict, args, model_dirs: dict) -> dict:
    from nd_parallel.planner import Cluster, Training, peak_memory, spec_from_path, step_time

    r = data["rates"]
    cluster = Cluster(nodes=1, gpus_per_node=WORLD, gpu_memory=2**40, intra_bw=r["bandwidth"],
                      inter_bw=r["bandwidth"], flops=r["flops"], efficiency=1.0, mem_bw=r["mem_bw"],
                      latency=r["latency"], device="cpu",
                      **{field: r[key] for field, key in (("op_overhead", "op_s"), ("dtensor_op_overhead", "dtensor_op_s"),
                                                          ("p2p_latency", "p2p_latency"),
                                                          ("idle_speedup", "idle_speedup")) if key in r})
    rows = []
    for key, run in data["runs"].items():
        shape, name = key.split("/")
        lay, extra = _layout(name, args)
        spec, kw = spec_from_path(model_dirs[shape]), LAYOUTS[name][0]
        train = Training(seq_len=_seq(shape, args), global_batch=args.global_batch, lora_rank=extra.get("lora"),
                         dtype="bf16" if extra.get("bf16") else "fp32", loss_chunk=kw.get("loss_chunk_size", "auto"),
                         sequence_parallel=kw.get("sequence_parallel", True))
        mem = peak_memory(spec, train, lay, cluster)
        row = {"shape": shape, "layout": name, "predicted_peak": mem.peak, "predicted_phase": mem.phase,
               "predicted_parts": mem.parts, "predicted_step_s": sum(step_time(spec, train, lay, cluster).values())}
        if "error" in run:
            row["error"] = run["error"]
        else:
            measured = max(run["peaks"])
            row.update(measured_peak=measured, measured_peaks=run["peaks"], measured_step_s=run["step_s"],
                       measured_min_step_s=run.get("min_step_s"), error=None, mem_err=mem.peak / measured - 1)
        rows.append(row)
    return {"rates": r, "rows": rows, "summary": summarize(rows), "raw": data}


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if not r.get("error")]
    errs = [abs(r["mem_err"]) for r in ok]
    out = {"layouts": len(ok), "failed": [f"{r['shape']}/{r['layout']}" for r in rows if r.get("error")],
           "held_out": any(r["shape"] in HELD_OUT for r in ok),
           "mem_abs_err_median": statistics.median(errs) if errs else None, "mem_abs_err_worst": max(errs, default=None)}
    for shape in sorted({r["shape"] for r in ok}):
        mine = [r for r in ok if r["shape"] == shape]
        pred, meas = [r["predicted_step_s"] for r in mine], [r["measured_step_s"] for r in mine]
        top = min(mine, key=lambda r: r["predicted_step_s"])
        out[shape] = {"spearman": _spearman(pred, meas), "predicted_top": top["layout"],
                      "top_gap": top["measured_step_s"] / min(meas) - 1,
                      "measured_best": min(mine, key=lambda r: r["measured_step_s"])["layout"]}
        if all(r.get("measured_min_step_s") for r in mine):  # the least disturbed step (others share the cores)
            least = [r["measured_min_step_s"] for r in mine]
            out[shape].update(spearman_min=_spearman(pred, least), top_gap_min=top["measured_min_step_s"] / min(least) - 1)
    return out


def print_report(rep: dict) -> None:
    mib = 2.0**20
    r = rep["rates"]
    print(f"rates per rank (4 ranks busy): matmul {r['flops'] / 1e9:.2f} GFLOP/s, elementwise {r['mem_bw'] / 1e9:.2f} "
          f"GB/s, all-reduce latency {r['latency'] * 1e6:.0f} us, bandwidth {r['bandwidth'] / 1e9:.2f} GB/s")
    if "op_s" in r:
        print(f"  per op {r['op_s'] * 1e6:.1f} us, per DTensor op {r['dtensor_op_s'] * 1e6:.0f} us, send/recv "
              f"{r['p2p_latency'] * 1e6:.0f} us, one rank alone {r['idle_speedup']:.2f}x faster")
    else:
        print("  (no per-op rates stored: the planner's defaults stand in for them)")
    print(f"{'shape':<26} {'layout':<20} {'pred MiB':>9} {'meas MiB':>9} {'err':>7} {'pred s':>7} {'meas s':>7}  phase")
    for row in rep["rows"]:
        if row.get("error"):
            print(f"{row['shape']:<26} {row['layout']:<20} FAILED: {row['error'][:100]}")
            continue
        print(f"{row['shape']:<26} {row['layout']:<20} {row['predicted_peak'] / mib:9.1f} "
              f"{row['measured_peak'] / mib:9.1f} {row['mem_err']:+7.1%} "
              f"{row['predicted_step_s']:7.3f} {row['measured_step_s']:7.3f}  {row['predicted_phase']}")
    s = rep["summary"]
    sample = "OUT OF SAMPLE (held-out shapes)" if s["held_out"] else "in sample (the shapes the model was fixed on)"
    print(f"memory |error|, {sample}: median {s['mem_abs_err_median']:.1%}, worst {s['mem_abs_err_worst']:.1%} over "
          f"{s['layouts']} layouts (targets 10% / 20%)")
    for shape, v in s.items():
        if isinstance(v, dict):
            print(f"{shape}: Spearman {v['spearman']:.2f} (target >= 0.8); predicted top {v['predicted_top']} measured "
                  f"{v['top_gap']:+.1%} vs the best measured ({v['measured_best']}) (target <= 10%)")
            if "spearman_min" in v:
                print(f"{shape} on each layout's fastest step: Spearman {v['spearman_min']:.2f}, top-1 gap "
                      f"{v['top_gap_min']:+.1%}")


def _save_models(args, tmp: str) -> dict[str, str]:
    from nd_parallel.testing.models import save_tiny_model

    dirs = {}
    for shape in args.shapes.split(","):
        family, overrides = (SHAPES[shape] if shape in SHAPES else HELD_OUT[shape][:2])
        dirs[shape] = str(save_tiny_model(family, Path(tmp) / shape,
                                          max_position_embeddings=max(_seq(shape, args), 256), **overrides))
    return dirs


def _seq(shape: str, args) -> int:
    """A held-out shape brings its own sequence length; the in-sample ones use --seq."""
    return HELD_OUT[shape][2] if shape in HELD_OUT else args.seq


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, seq=256, global_batch=8, steps=(3, "timed steps per layout after one warm-up"),
                  layouts=",".join(k for k in LAYOUTS if k not in EXTRA), shapes=",".join(SHAPES))
    p.add_argument("--from-json", help="re-print a report written by --json")
    p.add_argument("--held-out", action="store_true", help="measure the HELD_OUT shapes (out of sample)")
    # --quick is applied in parent(), after --from-json: a re-print covers every shape the stored run measured
    return _common.parse(p, argv, json_help="also write the report here", internal=("--models", "--seqs"))


def parent(args, argv) -> None:
    if args.held_out:
        args.shapes = ",".join(HELD_OUT)
    if args.quick and not args.from_json:  # a re-print covers every shape the stored run measured
        args.layouts, args.shapes, args.steps = ",".join(QUICK), args.shapes.split(",")[0], 2
    with tempfile.TemporaryDirectory() as tmp:
        dirs = _save_models(args, tmp)
        if args.from_json:  # predict again (the model may have changed) against the stored measurements
            data = json.loads(Path(args.from_json).read_text())["raw"]
        else:
            seqs = {shape: _seq(shape, args) for shape in dirs}
            forwarded = [f"--seq={args.seq}", f"--global-batch={args.global_batch}", f"--steps={args.steps}",
                         f"--layouts={args.layouts}", f"--models={json.dumps(dirs)}", f"--seqs={json.dumps(seqs)}"]
            data = _common.launch_self(__file__, WORLD, forwarded, timeout=3000,
                                       env={"TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"})
        rep = report(data, args, dirs)
    print_report(rep)
    _common.write_json(args.json, rep)


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
