"""The loss without the full logits: peak memory per rank and step time, chunked loss vs transformers' loss.

For each layout (one process, FSDP2, TP2, PP2, CP2 on 2 ranks) one launch prepares the same Llama-shaped model
three times (default vocab 128k, hidden 256, 2 layers, fp32, one sample per data-parallel rank): with the chunked
loss (``loss_chunk_size``, default "auto": 1/8 of the tokens one loss call sees, within [128, 256]) as it runs,
on its linear fast path where the head is one linear map
(distributed/linear_loss.py; TP2's vocabulary-parallel head keeps the generic path); with the chunked loss forced
onto its generic path (``ChunkedHead.fast_linear = False``: the model's own head per chunk, autograd per chunk);
and with HF's loss on the full logits (``loss_chunk_size=0``). They alternate step by step inside the launch, so
machine noise hits them alike.

- **peak**: peak live tensor bytes during forward + backward of one step minus what was alive before it
  (parameters, gradients kept allocated, optimizer state), with the planner's allocator-level tracker
  (nd_parallel/planner/measure.py); max over ranks.
- **saved**: HF's peak minus the chunked peak, next to the formula: HF's fp32 logits are 4·s·b·V bytes (b·s the
  tokens one rank's loss sees at once: s/cp under CP, one micro-batch under PP), the chunked loss holds one
  chunk's, 4·c·V, and under TP2 (vocabulary-parallel) 4·c·V/2 per rank. The loss keeps a few buffers of that size
  alive at once (logits, log-softmax, their gradient), so the saving is a multiple of the logits buffer.
- **loss term chunked / HF**: the loss's bytes at the start of backward, chunked over HF's: measured as HF's term
  (the planner's 16·t·V) less the saving, next to the planner's own ratio, for the chunked loss as it runs and
  for its generic path. The goal is <= 1/8. **chunk**: the tokens per chunk ``--chunk`` gives at this layout's
  tokens per loss call (config/loss.py's ``loss_chunk_for``).
- **loss term in forward chunked / HF**: the same over the forward alone (the peak from the step's start to the end
  of the forward), where both variants hold the same activations and FSDP2's reduce-scatter of the root group's
  gradients at the end of backward (the whole step's peak under FSDP2 and CP2 at vocab 128k, whatever the loss)
  has not run: HF's forward holds 8·t·V of its loss (fp32 logits and log-softmax output), the chunked loss all of
  its own (its backward runs inside the forward). Not for PP2, whose forward call runs the whole schedule (and has
  no FSDP).
- **step time**: forward + backward + AdamW step, median over the timed steps, slowest rank: chunked / HF and
  chunked / generic (the fast path against the path it replaces).

    python benchmarks/bench_logits_memory.py                       # seq 2048 and 4096, vocab 128k
    python benchmarks/bench_logits_memory.py --seqs 2048 --layouts one,fsdp2
    python benchmarks/bench_logits_memory.py --quick               # smoke run (vocab 16k, seq 512)
    python benchmarks/bench_logits_memory.py --variants chunked,hf  # without the generic path (its columns: nan)
    python benchmarks/bench_logits_memory.py --chunk 256            # a fixed chunk (the "auto" default before)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch

LAYOUTS = {"one": (1, {}), "fsdp2": (2, dict(dp_shard_size=2)), "tp2": (2, dict(tp_size=2)),
           "pp2": (2, dict(pp_size=2, pp_microbatches=2)), "cp2": (2, dict(cp_size=2))}
VARIANTS = ("chunked", "generic", "hf")


def _tokens_per_loss(name: str, seq: int) -> int:
    """Tokens whose logits one rank's loss holds at once under HF's loss (batch 1 per dp rank / micro-batch)."""
    return seq // 2 if name == "cp2" else seq


def _vocab_split(name: str) -> int:
    """Under TP2 the chunked loss is vocabulary-parallel: each rank holds V/2 of a chunk's logits (HF's gathers)."""
    return LAYOUTS[name][1].get("tp_size", 1)


def _setting(args) -> int | str:
    """``--chunk`` as a loss_chunk_size: "auto" or a number of tokens."""
    return args.chunk if args.chunk == "auto" else int(args.chunk)


def chunk_tokens(name: str, seq: int, args) -> int:
    """Tokens per chunk of this layout's loss calls, as the chunked loss resolves ``--chunk`` at run time."""
    from nd_parallel.config.loss import loss_chunk_for

    t = _tokens_per_loss(name, seq)
    return min(loss_chunk_for(_setting(args), t), t)


def loss_terms(name: str, seq: int, args) -> tuple[float, float, float]:
    """(HF's loss bytes at the start of backward, the chunked loss's, its generic path's), the planner's formulas
    (planner/memory.py, validated against a measured step in tests/unit/test_planner.py): HF's logits, log-softmax
    and both gradients in fp32, 16·t·V. The generic path: one chunk of those over V/tp, the hidden states' gradient
    4·t·h and two fp32 copies of the head's gradient 2·4·V·h/tp. The linear fast path (not under TP2 here): one fp32
    chunk buffer 4·c·V, 4·t·h and one head gradient 4·V·h."""
    t, v, h, tp = _tokens_per_loss(name, seq), args.vocab, args.hidden, _vocab_split(name)
    c = chunk_tokens(name, seq, args)
    generic = 16 * c * v / tp + 4 * t * h + 8 * v * h / tp
    fast = tp == 1
    return 16 * t * v, 4 * c * v + 4 * t * h + 4 * v * h if fast else generic, generic


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.distributed.chunked_loss import ChunkedHead
    from nd_parallel.planner.measure import LiveTensorBytes, state_tensors
    from nd_parallel.testing.models import make_samples
    from nd_parallel.testing.parity import _collate

    _common.quiet_transformers()
    layout = json.loads(args.layout)
    seq = int(args.seq)  # an internal flag: a string
    samples = make_samples(n=4, seq_len=seq, min_len=seq)
    runs = {}
    for variant in args.variants.split(","):
        AcceleratorState._reset_state(reset_partial_state=False)
        accelerator = Accelerator()
        chunk = 0 if variant == "hf" else _setting(args)
        ChunkedHead.fast_linear = variant != "generic"  # read by each ChunkedHead when the model is prepared
        plugin = NDParallelPlugin(ParallelismConfig(**layout, loss_chunk_size=chunk)).attach(accelerator)
        model = plugin.from_pretrained(args.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        per_rank = 2 if layout.get("pp_size", 1) > 1 else 1
        loader = DataLoader(samples, batch_size=per_rank, collate_fn=_collate)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        ChunkedHead.fast_linear = True
        runs[variant] = (accelerator, model, opt, next(iter(loader)))
    peaks, forward_peaks, times = {}, {}, {v: [] for v in runs}
    measured_at = max(1, args.warmup)  # after a step, so gradients exist and count as state
    for step in range(measured_at + 1 + args.steps):
        for variant, (accelerator, model, opt, batch) in runs.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            if step == measured_at:
                peak = LiveTensorBytes(state_tensors(model, opt))
                before = peak.current
                with peak:
                    out = model(**batch)
                    forward_peaks[variant] = peak.peak - before
                    accelerator.backward(out.loss)
                peaks[variant] = peak.peak - before
            else:
                out = model(**batch)
                accelerator.backward(out.loss)
            opt.step()
            opt.zero_grad(set_to_none=False)
            out.loss.item()
            if step > measured_at:
                times[variant].append(time.perf_counter() - start)
    every = _common.gather({"peak": peaks, "forward": forward_peaks,
                            "time": {v: statistics.median(t) for v, t in times.items()}})
    _common.write_result(args, {key: {v: max(r[key][v] for r in every) for v in runs}
                                for key in ("peak", "forward", "time")})


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, seqs="2048,4096", vocab=131072, hidden=256, layers=2, steps=2, warmup=1,
                  chunk=("auto", "loss_chunk_size of the chunked variants: auto, or tokens per chunk [auto]"),
                  layouts=",".join(LAYOUTS), variants=",".join(VARIANTS))
    return _common.parse(p, argv, quick={"seqs": "512", "vocab": 16384, "steps": 1},
                         internal=("--layout", "--model", "--seq"))


HEAD = ["seq", "layout", "chunk", "peak HF (MiB)", "peak chunked (MiB)", "peak generic (MiB)", "chunked / HF",
        "saved (MiB)",
        "HF logits 4·s·b·V (MiB)", "one chunk 4·c·V/tp (MiB)", "saved / HF logits", "loss term chunked / HF",
        "planner's", "loss term in forward chunked / HF", "loss term generic / HF", "planner's (generic)",
        "time chunked / HF", "time chunked / generic"]


def table_row(seq: int, name: str, res: dict, args) -> list[str]:
    hf, ours, generic = (res["peak"].get(v, float("nan")) / _common.MB for v in ("hf", "chunked", "generic"))
    logits = 4 * _tokens_per_loss(name, seq) * args.vocab / _common.MB
    c = chunk_tokens(name, seq, args)
    chunk = 4 * c * args.vocab / _vocab_split(name) / _common.MB
    hf_term, chunked_term, generic_term = (b / _common.MB for b in loss_terms(name, seq, args))
    # measured: HF's loss term (its formula) less what the chunked run saved on the same step
    measured, measured_generic = ((hf_term - (hf - peak)) / hf_term for peak in (ours, generic))
    # the same over the forward alone, where both hold the same activations and no FSDP reduce-scatter runs: HF's
    # forward holds 8·t·V of its loss (logits and log-softmax output, fp32), the chunked loss all of its own (its
    # backward runs inside the forward); not under PP, whose forward call runs the whole schedule
    forward = res.get("forward", {})
    in_forward = (8 * _tokens_per_loss(name, seq) * args.vocab / _common.MB
                  - (forward.get("hf", float("nan")) - forward.get("chunked", float("nan"))) / _common.MB) / hf_term
    in_forward = float("nan") if name == "pp2" else in_forward
    time = {v: res["time"].get(v, float("nan")) for v in ("chunked", "hf", "generic")}  # --variants may omit some
    return [seq, name, c, f"{hf:.0f}", f"{ours:.0f}", f"{generic:.0f}", f"{ours / hf:.2f}", f"{hf - ours:.0f}",
            f"{logits:.0f}", f"{chunk:.0f}", f"{(hf - ours) / logits:.2f}", f"{measured:.3f}",
            f"{chunked_term / hf_term:.3f}", f"{in_forward:.3f}", f"{measured_generic:.3f}",
            f"{generic_term / hf_term:.3f}",
            f"{time['chunked'] / time['hf']:.2f}x", f"{time['chunked'] / time['generic']:.2f}x"]


def parent(args, argv) -> None:
    rows, raw = [], []
    seqs = [int(s) for s in args.seqs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = _common.save_llama(Path(tmp) / "m", args.hidden, args.layers, heads=4, vocab_size=args.vocab,
                                   max_position_embeddings=max(seqs))
        for seq in seqs:
            for name in args.layouts.split(","):
                world, layout = LAYOUTS[name]
                print(f"-- seq {seq}, {name} ({world} rank(s))", file=sys.stderr, flush=True)
                res, took = _common.launch_timed(__file__, world, [
                    f"--seq={seq}", f"--steps={args.steps}", f"--variants={args.variants}", f"--warmup={args.warmup}",
                    f"--chunk={args.chunk}",
                    f"--layout={json.dumps(layout)}", f"--model={model}"], timeout=3600)
                print(f"   launch took {took}", file=sys.stderr, flush=True)
                rows.append(table_row(seq, name, res, args))
                raw.append((seq, name, res))
    _common.print_report(f"llama vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, fp32, batch 1 per dp "
                         f"rank (PP: 2 micro-batches of 1), loss_chunk_size {args.chunk}", HEAD, rows, raw)


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
