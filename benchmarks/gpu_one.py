"""One GPU, one run, one table: nd_parallel's one-process recipe against plain transformers, and the CUDA attention
paths, on a Llama-3.2-1B-shaped model (random init from a config: nothing is downloaded).

Training rows (one process, the same random batches, ``--steps`` timed steps after ``--warmup``):

- **transformers**: ``AutoModelForCausalLM.from_config`` with SDPA, fp32 weights under ``torch.autocast(bf16)``
  (what ``Trainer(bf16=True)`` runs), HF's loss on the full fp32 logits, AdamW.
- **nd_parallel ...**: the same model prepared by ``Accelerator(mixed_precision="bf16")`` + ``NDParallelPlugin``:
  bf16 compute over fp32 weights, the chunked loss (``loss_chunk_size="auto"``), then with ``compile=True``
  (inductor), ``activation_checkpointing="selective"`` and compile with ``"full"`` checkpointing (compile refuses
  selective: config/compile.py says why).

Columns: step time (median), tokens/s, MFU = 6·N·tokens + 6·L·d·s·tokens (causal attention) model FLOPs per
second over the GPU's dense bf16 peak (``PEAKS``, matched on the device name; ``--peak-tflops`` overrides; recompute
under checkpointing is not counted, as in MFU's definition), and peak memory (``torch.cuda.max_memory_allocated``).

Attention rows (fwd+bwd of one layer's attention at ``--attn-seq``, bf16, GQA 32/8 heads):
torch's SDPA (flash on Hopper), our ring kernel with one cp block (``local_attention``: on CUDA its blocks are the
fp32 ``math`` kernel; there is no CUDA flash block kernel yet), a flash block through
``aten._scaled_dot_product_flash_attention`` (out and log-sum-exp, what a CUDA block kernel for the ring would
call) checked against the ring's math block, and ``cp_backend="torch"`` (torch's context_parallel SDPA) over a
one-rank mesh. Each row reports its max error against SDPA (or the reason it did not run).

    python benchmarks/gpu_one.py              # one CUDA GPU; <= 8 min on an H200 (--budget stops rows early)
    python benchmarks/gpu_one.py --dry-run    # CPU, tiny sizes: the script's own check (tests/unit/test_gpu_one.py)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets; first matching substring wins.
PEAKS = [("H200", 989.0), ("GH200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0),
         ("B200", 2250.0), ("B100", 1750.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0),
         ("A10G", 70.0), ("RTX 4090", 165.2), ("RTX 6000 Ada", 364.0), ("MI300X", 1307.0)]
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5, use_cache=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256, use_cache=False)
# use_cache=False: with a KV cache in the training forward every layer's cache.update guard differs, so dynamo
# recompiles per layer and past its recompile_limit (8) runs the later layers eager (seen with torch 2.13; see
# nd_parallel/distributed/compile.py). A training step never reads that cache, so no row changes its numbers.
RECIPES = {  # row name -> ParallelismConfig kwargs (None: plain transformers)
    "transformers (autocast bf16, HF loss)": None,
    "nd_parallel bf16 + chunked loss": {},
    "nd_parallel + compile": dict(compile=True),
    "nd_parallel + selective AC": dict(activation_checkpointing="selective"),
    "nd_parallel + compile + full AC": dict(compile=True, activation_checkpointing="full"),
}


def peak_tflops(device: torch.device, override: float | None) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", override
    name = torch.cuda.get_device_name(device)
    if override:
        return name, override
    return name, next((peak for key, peak in PEAKS if key in name), None)


def model_flops_per_token(config, seq: int) -> float:
    """6·N (forward + backward of every weight matmul; a tied head counts once, as its one matrix) plus causal
    attention's 6·L·d·s (QK^T and PV: 2·2·s·d per token forward, halved by causality, x3 with backward)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    heads_dim = config.num_attention_heads * config.head_dim
    return 6.0 * n + 6.0 * config.num_hidden_layers * heads_dim * seq


def build(config, device, kwargs):
    """The model, its optimizer and the step function of one row."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    if kwargs is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)

        def step(batch):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            return loss

        return model, opt, step
    from nd_parallel import NDParallelPlugin, ParallelismConfig

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")
    NDParallelPlugin(ParallelismConfig(**kwargs)).attach(accelerator)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt = accelerator.prepare(model, opt)

    def step(batch):
        loss = model(**batch).loss
        accelerator.backward(loss)
        return loss

    return model, opt, step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_row(name, kwargs, config, args, device) -> dict:
    if kwargs and kwargs.get("compile"):
        kwargs = dict(kwargs, compile_backend=args.compile_backend)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, opt, step = build(config, device, kwargs)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(device)}
    batch["labels"] = batch["input_ids"]
    times, first, losses = [], 0.0, []
    for i in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        loss = step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs
        took = time.perf_counter() - start
        if i < args.warmup:
            first += took
        else:
            times.append(took)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model, opt, step
    return {"name": name, "step": statistics.median(times), "first": first, "loss": losses[0], "peak_gib": peak,
            "backend": kwargs.get("compile_backend") if kwargs else None}


def timed(fn, device, repeat: int) -> float:
    fn()  # warm-up (kernel selection, allocation)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeat


def attention_inputs(args, config, device):
    g = torch.Generator().manual_seed(2)
    shape = lambda h: (1, h, args.attn_seq, config.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=g).to(device, torch.bfloat16).requires_grad_()
               for h in (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads))
    dout = torch.randn(shape(config.num_attention_heads), generator=g).to(device, torch.bfloat16)
    return q, k, v, dout


def one_rank_mesh(device):
    """A one-rank process group and mesh in this process (for cp_backend="torch"); torn down by the caller."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return init_device_mesh(device.type, (1,), mesh_dim_names=("cp",))


def attention_paths(q, k, v, device):
    """name -> fn(q, k, v) -> out for every path; each fn raises where the device does not allow it."""
    import torch.nn.functional as F

    from nd_parallel.distributed.context_parallel.blocks import KVMeta
    from nd_parallel.distributed.context_parallel.hf import CPRuntime, torch_cp_attention
    from nd_parallel.distributed.context_parallel.ring import local_attention

    scale = q.shape[-1] ** -0.5
    meta = KVMeta(index=torch.arange(q.shape[2], device=device))

    def flash_block(q, k, v):
        if device.type != "cuda":
            raise RuntimeError("aten._scaled_dot_product_flash_attention is CUDA only")
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True, scale=scale)[0]

    def torch_cp(q, k, v):
        runtime = CPRuntime(group=None, size=1, rank=0, backend="torch", load_balance=False,
                            mesh=one_rank_mesh(device))
        return torch_cp_attention(runtime, q, k, v, scale=scale, causal=True)

    return {
        "SDPA (torch picks flash / efficient / math)": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        "ring kernel, cp=1 (one block; math on CUDA, flash_cpu on CPU)": lambda q, k, v: local_attention(
            q, k, v, meta, scale=scale, causal=True),
        "flash block (aten flash: out + lse, a ring block candidate)": flash_block,
        'cp_backend="torch", one-rank mesh': torch_cp,
    }


def attention_rows(args, config, device) -> list[dict]:
    q, k, v, dout = attention_inputs(args, config, device)
    rows, ref = [], None
    for name, fn in attention_paths(q, k, v, device).items():
        try:
            out = fn(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            if ref is None:
                ref = (out.float(), [g.float() for g in grads])
            err = max([(out.float() - ref[0]).abs().max().item()]
                      + [(g.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-12)
                         for g, r in zip(grads, ref[1])])

            def fwd_bwd():
                torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

            rows.append({"name": name, "ms": 1e3 * timed(fwd_bwd, device, args.attn_repeat), "err": err})
        except Exception as exc:  # report and go on: one path failing says something; the run must finish
            rows.append({"name": name, "ms": None, "err": None, "why": f"{type(exc).__name__}: {exc}"[:160]})
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model and sequences: checks the script runs")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps per row (compilation happens here)")
    p.add_argument("--attn-seq", type=int, default=8192)
    p.add_argument("--attn-repeat", type=int, default=10)
    p.add_argument("--rows", default=",".join(str(i) for i in range(len(RECIPES))), help="which training rows")
    p.add_argument("--budget", type=float, default=420.0, help="seconds; later training rows are skipped past it")
    p.add_argument("--compile-backend", default="inductor", help="for the compile rows (--dry-run: aot_eager)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not in PEAKS")
    args = p.parse_args(argv)
    if args.dry_run:
        # inductor's C++ build of the layers takes minutes on a busy CPU; aot_eager traces the same graphs
        args.seq, args.batch, args.steps, args.warmup, args.attn_seq, args.attn_repeat = 32, 2, 1, 0, 64, 1
        args.compile_backend = "aot_eager"
    return args


def report(rows, attn, args, device_name, peak, flops_per_token, elapsed) -> list[str]:
    tokens = args.batch * args.seq
    lines = [f"device {device_name}, bf16 peak {peak or 'unknown'} TFLOP/s; seq {args.seq} x batch {args.batch}; "
             f"torch {torch.__version__}; compile backend {args.compile_backend}; {args.steps} timed steps after "
             f"{args.warmup}; total {elapsed:.0f} s", "",
             "| training | step (ms) | tokens/s | MFU | peak mem (GiB) | first steps (s) | vs transformers | loss, step 1 |",
             "|---|---|---|---|---|---|---|---|"]
    base = next((r["step"] for r in rows if "step" in r and r["name"].startswith("transformers")), None)
    for r in rows:
        if "step" not in r:
            lines.append(f"| {r['name']} | {r['why']} | | | | | | |")
            continue
        mfu = f"{100 * flops_per_token * tokens / r['step'] / (peak * 1e12):.1f}%" if peak else "n/a"
        mem = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a (CPU)"
        ratio = f"{base / r['step']:.2f}x" if base else ""
        lines.append(f"| {r['name']} | {1e3 * r['step']:.0f} | {tokens / r['step']:.0f} | {mfu} | {mem} | "
                     f"{r['first']:.1f} | {ratio} | {r['loss']:.4f} |")
    lines += ["", f"| attention, seq {args.attn_seq} (fwd+bwd) | ms | max err vs SDPA (out abs, grads rel) |",
              "|---|---|---|"]
    for a in attn:
        lines.append(f"| {a['name']} | {a['ms']:.2f} | {a['err']:.2e} |" if a["ms"] is not None
                     else f"| {a['name']} | not run | {a['why']} |")
    return lines


def main(argv=None) -> list[str]:
    from transformers import LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_one.py measures a CUDA GPU and none is visible; use --dry-run to check it on CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    config = LlamaConfig(**(TINY if args.dry_run else LLAMA_1B))
    device_name, peak = peak_tflops(device, args.peak_tflops)
    start, rows = time.perf_counter(), []
    for i, (name, kwargs) in enumerate(RECIPES.items()):
        if str(i) not in args.rows.split(","):
            continue
        if time.perf_counter() - start > args.budget:
            rows.append({"name": name, "why": f"skipped: past --budget {args.budget:.0f} s"})
            continue
        try:
            rows.append(train_row(name, kwargs, config, args, device))
        except Exception as exc:  # one row failing (OOM, a compile error) is a result; the table still prints
            rows.append({"name": name, "why": f"failed: {type(exc).__name__}: {exc}"[:200]})
    attn = attention_rows(args, config, device)
    lines = report(rows, attn, args, device_name, peak, model_flops_per_token(config, args.seq),
                   time.perf_counter() - start)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
