"""Sequence parallelism: activation bytes per rank under TP2 / TP4 with SP vs without, next to the formula.

For each tp size one launch prepares the same Llama-shaped model twice (default hidden 256, 8 heads, 2 layers,
vocab 4096, fp32, one sample of ``--seqs`` tokens, the chunked loss) with ``sequence_parallel=True`` and ``False``;
the two alternate step by step inside the launch, so machine noise hits them alike.

- **held**: the bytes a training forward creates and still holds when it returns (what autograd keeps for backward),
  measured with the planner's allocator-level tracker (nd_parallel/planner/measure.py); max over ranks.
- **formula**: the non-TP-region activations are the norms' saved tensors (RMSNorm in transformers saves its fp32
  input and the normalised value, 8 bytes per element in fp32, plus a fp32 rsqrt per token), two per layer plus the
  final norm. SP keeps them on s/tp tokens, so it saves ``(1 - 1/tp)`` of them; each TP region's gathered input
  (what its colwise linears save) stays whole, as the planner's model (planner/memory.py) says. The planner's own
  prediction of the saving (``layer_activation_bytes`` with SP on and off) is printed next to it.
- **step time**: forward + backward + AdamW, median over the timed steps, slowest rank, SP / no SP.
- **under activation checkpointing** (second table): the same held bytes and step time with
  ``activation_checkpointing="selective"`` with SP and without, and ``"full"`` with SP, next to no checkpointing.
  Selective keeps matmul and collective outputs but recomputes a rowwise linear's partial sum (its only consumer is
  the reduce-scatter / all-reduce, whose output is kept): activation_checkpoint._partial_sum.

    python benchmarks/bench_sp_activations.py                      # seq 2048, tp 2 and 4
    python benchmarks/bench_sp_activations.py --quick              # smoke run (seq 256, tp 2)
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch

# name -> (sequence_parallel, activation_checkpointing)
VARIANTS = {"sp": (True, None), "no_sp": (False, None), "sp_selective": (True, "selective"),
            "selective": (False, "selective"), "sp_full": (True, "full")}


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.planner.measure import LiveTensorBytes
    from nd_parallel.testing.models import make_samples
    from nd_parallel.testing.parity import _collate

    _common.quiet_transformers()
    seq = int(args.seq)
    samples = make_samples(n=4, seq_len=seq, min_len=seq)
    runs = {}
    for variant, (sp, ac) in VARIANTS.items():
        AcceleratorState._reset_state(reset_partial_state=False)
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(tp_size=dist.get_world_size(), sequence_parallel=sp,
                                                    activation_checkpointing=ac))
        plugin.attach(accelerator)
        model = plugin.from_pretrained(args.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = DataLoader(samples, batch_size=1, collate_fn=_collate)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        runs[variant] = (accelerator, model, opt, next(iter(loader)))
    held, times = {}, {v: [] for v in VARIANTS}
    for step in range(2 + args.steps):
        for variant, (accelerator, model, opt, batch) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            if step == 1:  # after a step, so that nothing allocated once (optimizer state) counts
                with LiveTensorBytes([]) as live:
                    out = model(**batch)
                    gc.collect()
                    held[variant] = live.current
            else:
                out = model(**batch)
            accelerator.backward(out.loss)
            opt.step()
            opt.zero_grad(set_to_none=False)
            out.loss.item()
            if step > 1:
                times[variant].append(time.perf_counter() - start)
    every = _common.gather({"held": held, "time": {v: statistics.median(t) for v, t in times.items()}})
    _common.write_result(args, {key: {v: max(r[key][v] for r in every) for v in VARIANTS} for key in ("held", "time")})


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, seqs="2048", tps="2,4", vocab=4096, hidden=256, layers=2, heads=8, steps=3)
    return _common.parse(p, argv, quick={"seqs": "256", "tps": "2", "steps": 1}, internal=("--model", "--seq"))


def formula(args, seq: int, tp: int) -> tuple[float, float]:
    """(the norms' saved bytes per rank without SP, the saving SP's ÷ tp predicts), fp32, one sample."""
    norms = (2 * args.layers + 1) * seq * (8 * args.hidden + 4)
    return norms, norms * (1 - 1 / tp)


def planner_saving(args, model: str, seq: int, tp: int) -> float:
    from nd_parallel.planner.layout import Training
    from nd_parallel.planner.memory import layer_activation_bytes, norm_activation_bytes, sequence_split
    from nd_parallel.planner.spec import spec_from_path

    spec = spec_from_path(model)
    on, off = (Training(seq_len=seq, global_batch=1, dtype="fp32", sequence_parallel=sp) for sp in (True, False))
    per_layer = layer_activation_bytes(spec, off, tp, "none")[0] - layer_activation_bytes(spec, on, tp, "none")[0]
    final = (norm_activation_bytes(off, spec.hidden, sequence_split(spec, off, tp))
             - norm_activation_bytes(on, spec.hidden, sequence_split(spec, on, tp)))
    return seq * (spec.num_layers * per_layer + final)


HEAD = ["seq", "tp", "held no SP (MiB)", "held SP (MiB)", "SP / no SP", "saved (MiB)", "norms' bytes (MiB)",
        "formula (1-1/tp) (MiB)", "planner (MiB)", "saved / formula", "time SP / no SP"]


AC_HEAD = ["seq", "tp", "none, no SP (MiB)", "none, SP (MiB)", "selective, no SP (MiB)", "selective, SP (MiB)",
           "full, SP (MiB)", "selective SP / selective", "selective SP / none SP", "time selective SP / selective",
           "time selective SP / none SP"]


def ac_row(seq: int, tp: int, res: dict) -> list:
    held, t, mb = res["held"], res["time"], _common.MB
    return [seq, tp, *(f"{held[v] / mb:.2f}" for v in ("no_sp", "sp", "selective", "sp_selective", "sp_full")),
            f"{held['sp_selective'] / held['selective']:.2f}", f"{held['sp_selective'] / held['sp']:.2f}",
            f"{t['sp_selective'] / t['selective']:.2f}x", f"{t['sp_selective'] / t['sp']:.2f}x"]


def parent(args, argv) -> None:
    rows, ac_rows, raw = [], [], []
    mb = _common.MB
    with tempfile.TemporaryDirectory() as tmp:
        seqs = [int(s) for s in args.seqs.split(",")]
        model = _common.save_llama(Path(tmp) / "m", args.hidden, args.layers, heads=args.heads,
                                   vocab_size=args.vocab, max_position_embeddings=max(seqs))
        for seq in seqs:
            for tp in (int(t) for t in args.tps.split(",")):
                print(f"-- seq {seq}, tp {tp}", file=sys.stderr, flush=True)
                res, took = _common.launch_timed(__file__, tp, [f"--seq={seq}", f"--steps={args.steps}",
                                                                f"--model={model}"], timeout=3600)
                print(f"   launch took {took}", file=sys.stderr, flush=True)
                off, on = res["held"]["no_sp"], res["held"]["sp"]
                norms, saving = formula(args, seq, tp)
                rows.append([seq, tp, f"{off / mb:.1f}", f"{on / mb:.1f}", f"{on / off:.2f}", f"{(off - on) / mb:.1f}",
                             f"{norms / mb:.1f}", f"{saving / mb:.1f}",
                             f"{planner_saving(args, model, seq, tp) / mb:.1f}", f"{(off - on) / saving:.2f}",
                             f"{res['time']['sp'] / res['time']['no_sp']:.2f}x"])
                ac_rows.append(ac_row(seq, tp, res))
                raw.append((seq, tp, res))
    _common.print_report(f"llama hidden {args.hidden}, {args.heads} heads, {args.layers} layers, vocab {args.vocab}, "
                         "fp32, one sample, chunked loss", HEAD, rows, raw)
    _common.print_report("the same, under activation checkpointing (held bytes per rank, step time)", AC_HEAD, ac_rows,
                         [])


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
