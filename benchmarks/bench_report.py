"""Tables for bench_fsdp_tp.py, from the results its ranks gathered (pure Python: no torch, no processes)."""

from __future__ import annotations

import statistics

DP, TP = 2, 2
IMPLS = ("ours", "transformers", "raw")
PHASES = ("data", "forward", "backward", "clip", "optim")  # optim = optimizer.step + scheduler.step + zero_grad


def _ms(x: float) -> str:
    return f"{1000 * x:7.1f}"


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) == 1:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def _round_medians(xs: list[float], args) -> list[float]:
    return [statistics.median(xs[i * args.steps:(i + 1) * args.steps]) for i in range(args.rounds)]


def time_lines(title: str, series: dict[str, list[float]], args) -> list[str]:
    """Median, quartiles and per-round medians of one per-step series, and ours' ratios to the baselines."""
    med = {n: statistics.median(v) for n, v in series.items()}
    rounds = {n: _round_medians(v, args) for n, v in series.items()}
    lines = [f"{title:<16}   median      p25      p75      min   per-round medians"]
    for n in IMPLS:
        p25, p75 = _quartiles(series[n])
        lines.append(f"{n:<14} {_ms(med[n])}  {_ms(p25)}  {_ms(p75)}  {_ms(min(series[n]))}   "
                     + " ".join(f"{1000 * x:.0f}" for x in rounds[n]))
    for other in ("transformers", "raw"):
        # Paired: a round's steps of A and B ran back to back, so slow drifts of the load cancel in its ratio.
        paired = statistics.median(a / b for a, b in zip(rounds["ours"], rounds[other]))
        lines.append(f"  ours/{other:<13} {med['ours'] / med[other]:.3f} (ratio of medians)   "
                     f"{paired:.3f} (median of per-round ratios)")
    return lines + [""]


def memory_lines(result: dict, n_params: int) -> list[str]:
    per_copy = n_params * 4 // (DP * TP)  # one fp32 copy of the unsharded model, split over the ranks
    ideal = 4 * per_copy  # params + grads + AdamW exp_avg + exp_avg_sq
    lines = ["model-state bytes per rank after a step (params + grads + AdamW state); params..total: the storage",
             "behind the local tensors, each storage once; logical: the elements of the local tensors only",
             f"{'':<14} {'params':>10} {'grads':>10} {'AdamW':>10} {'total':>10} {'logical':>10}"
             "   per-rank totals (MiB)   max/ideal"]
    for n in IMPLS:
        per_rank = result[n]["bytes"]
        totals = [b["params"] + b["grads"] + b["optim"] for b in per_rank]
        r0 = per_rank[0]
        lines.append(f"{n:<14} {r0['params']:>10,} {r0['grads']:>10,} {r0['optim']:>10,} {totals[0]:>10,} "
                     f"{r0['logical']:>10,}   {'/'.join(f'{t / 2**20:.2f}' for t in totals):<23} "
                     f"{max(totals) / ideal:.3f}")
    lines.append(f"{'ideal':<14} {per_copy:>10,} {per_copy:>10,} {2 * per_copy:>10,} {ideal:>10,} {ideal:>10,}   "
                 f"16 B x {n_params:,} params / {DP * TP} ranks")
    return lines + [""]


def sanity_lines(result: dict) -> list[str]:
    ref = result["ours"]
    lines = ["sanity: first-step loss (global-token mean) and grad norm; same first batch on every rank"]
    for n in IMPLS:
        r = result[n]
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        lines.append(f"{n:<14} loss {r['losses'][0]:.6f}  norm {r['norms'][0]:.6f}  same batch: "
                     f"{r['same_first_batch']}   max |loss - ours| over {len(r['losses'])} steps: {worst:.2e}")
    first = [result[n]["losses"][0] for n in IMPLS]
    ok = max(first) - min(first) <= 1e-5 * abs(first[0]) and all(result[n]["same_first_batch"] for n in IMPLS)
    lines.append(f"first-step losses agree (rtol 1e-5): {'yes' if ok else 'NO'}")
    return lines


def collective_lines(counts: dict[str, dict[str, int]] | None) -> list[str]:
    if not counts:
        return []
    keys = sorted({k for c in counts.values() for k in c})
    lines = ["collective calls in one step on rank 0 (torch.profiler)",
             f"{'':<44}" + "".join(f"{n:>14}" for n in IMPLS)]
    lines += [f"{k:<44}" + "".join(f"{counts[n].get(k, 0):>14}" for n in IMPLS) for k in keys]
    return lines + [""]


def report(result: dict, args) -> str:
    meta = result["meta"]
    timed = slice(args.warmup, args.warmup + args.rounds * args.steps)
    lines = [
        f"model: {args.family} {meta['n_params'] / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers, "
        f"intermediate {args.intermediate}, heads {args.heads}/{args.kv_heads}), seq {args.seq}, {args.batch} samples "
        f"per dp rank; dp_shard={DP} x tp={TP} on {DP * TP} gloo ranks",
        f"torch {meta['torch']}, transformers {meta['transformers']}, accelerate {meta['accelerate']}, "
        f"{meta['cpus']} CPUs ({meta['cpu']}); load average {meta['loadavg_start']} at start, "
        f"{meta['loadavg_end']} at end",
        f"{args.rounds} rounds x {args.steps} steps per implementation, {args.warmup} warm-up steps discarded",
        "",
    ]
    lines += time_lines("step time (ms)", {n: result[n]["wall"][timed] for n in IMPLS}, args)
    lines += time_lines("CPU ms/step", {n: result[n]["cpu"][timed] for n in IMPLS}, args)
    lines += ["step time: the slowest rank's wall time from fetching the batch to loss.item()",
              "CPU ms/step: CPU time of the 4 rank processes together (less sensitive to other load)", ""]
    lines.append("median per phase (ms)  " + "".join(f"{ph:>10}" for ph in PHASES))
    for n in IMPLS:
        phase = [statistics.median(t[ph] for t in result[n]["times"][timed]) for ph in PHASES]
        lines.append(f"{n:<22} " + "".join(f"{1000 * x:10.1f}" for x in phase))
    lines += [f"one scalar all-reduce over the 2 dp ranks: {1000 * meta['allreduce_latency']:.2f} ms median "
              "(ours adds two per step for the global-token loss)", ""]
    lines += collective_lines(result.get("collectives"))
    lines += memory_lines(result, meta["n_params"])
    lines += sanity_lines(result)
    return "\n".join(lines)
