"""Context-parallel attention kernels: load balance, bytes on the wire, ring vs Ulysses.

One causal attention layer, B x Hq (Hkv) x S x D, forward + backward, split over cp ranks:
  (a) balance     per-rank causal work, max/mean over ranks, contiguous vs load-balanced shards (rank r holds
                  chunks r and 2cp-1-r of 2cp):
                    analytical  visible (q, k) pairs per rank, and the pairs the kernel's block plan computes
                    isolated    per-rank block-math CPU time, the ranks' work replayed one after the other in
                                this process (one thread): what each rank costs on a device of its own
                    in the ring per-rank block-math CPU time inside real ring runs (kernels.comm_stats)
  (b) bytes       bytes one rank sends per layer, forward and backward, counted in the kernels' P2P calls,
                  against the ring formula: forward (cp-1)*2*B*Hkv*S/cp*D*e, backward the same plus
                  cp*2*B*Hkv*S/cp*D*4 (the dK/dV accumulators travel in fp32)
  (c) ring vs Ulysses   wall time of forward + backward (slowest rank), and one process on the whole sequence

The layouts alternate in rounds (ring-contig, ring-lb, ulysses, ...) so machine load hits them alike, and
every time is the minimum over rounds: on a shared machine the least disturbed round is the closest to the
cost of the work (per-round medians go to --json). CPU seconds (thread_time) are used where the work is
one thread's, wall seconds where waiting is part of the answer.

    python benchmarks/bench_cp_attention.py             # S 4096, Hq 8, Hkv 4, D 64, B 1, cp 2 and 4
    python benchmarks/bench_cp_attention.py --quick     # smoke run: S 512, 1 round
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import _common
import torch

LAYOUTS = ("ring-contig", "ring-lb", "ulysses")


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, seq=4096, heads=8, kv_heads=4, head_dim=64, batch=1)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    _common.flags(p, kernel=("auto", "block kernel: auto (flash_cpu on CPU) | math | flash_cpu"),
                  rounds=(5, "timed rounds per layout, after one warm-up [5]"))
    args = _common.parse(p, argv, quick={"seq": 512, "rounds": 1}, json_help="also write the raw results here",
                         timeout=1200)
    for cp in args.cp:
        if args.seq % (2 * cp) or args.heads % cp or args.kv_heads % cp:
            p.error(f"--seq {args.seq}, --heads {args.heads}, --kv-heads {args.kv_heads}: cp={cp} must divide both "
                    f"head counts and 2*cp the sequence")
    return args


def shard_index(rank: int, cp: int, seq: int, load_balance: bool) -> torch.Tensor:
    if not load_balance:
        n = seq // cp
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])


def metas_for(cp: int, seq: int, load_balance: bool):
    from nd_parallel.distributed.context_parallel.attention import KVMeta

    return [KVMeta(shard_index(r, cp, seq, load_balance)) for r in range(cp)]


def inputs(args):
    g = torch.Generator().manual_seed(0)
    b, s, d = args.batch, args.seq, args.head_dim
    q = torch.randn(b, args.heads, s, d, generator=g)
    k, v = (torch.randn(b, args.kv_heads, s, d, generator=g) for _ in range(2))
    return q, k, v, torch.randn(b, args.heads, s, d, generator=g)


def ratio(values) -> float:
    return max(values) / statistics.mean(values)


# ------------------------------------------------------------------------------------ (a) analytical
def analytical(cp: int, seq: int) -> dict:
    """Per rank: causal (q, k) pairs visible (index_q + 1 keys per query), and pairs the block plan computes."""
    from nd_parallel.distributed.context_parallel.attention import plan_blocks

    out = {}
    for name, lb in (("contig", False), ("lb", True)):
        metas = metas_for(cp, seq, lb)
        visible = [int((m.index + 1).sum()) for m in metas]
        computed = [sum((b.q1 - b.q0) * (b.k1 - b.k0) for src in metas
                        for b in plan_blocks(metas[r], src, causal=True, sliding_window=None)) for r in range(cp)]
        out[name] = {"visible": visible, "computed": computed}
    return out


# ------------------------------------------------------------------------------------ (a) isolated
def replay_rank(r, cp, metas, q, k, v, grad, scale, kernel):
    """Rank r's forward and backward block math of a ring pass, without communication."""
    from nd_parallel.distributed.context_parallel.blocks import backward_lse, merge, pick_kernel, plan_blocks

    fwd, bwd = pick_kernel(kernel, q.device, None)
    mine = metas[r].index
    qr, gr = q[:, :, mine].contiguous(), grad[:, :, mine].contiguous()
    out = torch.zeros_like(qr)
    lse = torch.full(qr.shape[:3], float("-inf"))
    plans = [(metas[(r - t) % cp].index, plan_blocks(metas[r], metas[(r - t) % cp], causal=True, sliding_window=None))
             for t in range(cp)]
    for idx, blocks in plans:
        ks, vs = k[:, :, idx], v[:, :, idx]
        for b in blocks:
            o, l = fwd(qr[:, :, b.q0:b.q1], ks[:, :, b.k0:b.k1], vs[:, :, b.k0:b.k1], b.mask, scale, None, b.causal)
            merge(out[:, :, b.q0:b.q1], lse[:, :, b.q0:b.q1], o, l)
    lse = backward_lse(lse)
    for idx, blocks in plans:
        ks, vs = k[:, :, idx], v[:, :, idx]
        for b in blocks:
            rows, cols = slice(b.q0, b.q1), slice(b.k0, b.k1)
            bwd(gr[:, :, rows], qr[:, :, rows], ks[:, :, cols], vs[:, :, cols], out[:, :, rows], lse[:, :, rows],
                b.mask, scale, None, b.causal)


def isolated(args, cp: int) -> dict:
    torch.set_num_threads(1)  # as one rank
    q, k, v, grad = inputs(args)
    scale = args.head_dim ** -0.5
    times = {"contig": [[] for _ in range(cp)], "lb": [[] for _ in range(cp)]}
    for rnd in range(args.rounds + 1):
        for name, lb in (("contig", False), ("lb", True)):
            metas = metas_for(cp, args.seq, lb)
            for r in range(cp):
                t0 = time.thread_time()
                replay_rank(r, cp, metas, q, k, v, grad, scale, args.kernel)
                if rnd:  # round 0 warms up
                    times[name][r].append(time.thread_time() - t0)
    return {name: [min(t) for t in per_rank] for name, per_rank in times.items()}


def single(args) -> dict:
    """One process, one thread, the whole sequence, the same kernel (no ranks alive meanwhile)."""
    from nd_parallel.distributed.context_parallel.attention import KVMeta, comm_stats, local_attention

    torch.set_num_threads(1)
    q, k, v, grad = inputs(args)
    walls, cpus = [], []
    for rnd in range(args.rounds + 1):
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        comm_stats.reset()
        t0 = time.perf_counter()
        out = local_attention(qf, kf, vf, KVMeta(torch.arange(args.seq)), scale=args.head_dim ** -0.5,
                              kernel=args.kernel)
        out.backward(grad)
        if rnd:
            walls.append(time.perf_counter() - t0)
            cpus.append(comm_stats.compute_s)
    return {"wall_s": min(walls), "wall_median_s": statistics.median(walls), "compute_s": min(cpus)}


# ------------------------------------------------------------------------------------ ranks
def worker(args) -> None:
    import torch.distributed as dist

    from nd_parallel.distributed.context_parallel.attention import comm_stats, ring_attention, ulysses_attention

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    q, k, v, grad = inputs(args)
    scale = args.head_dim ** -0.5
    runs = {name: [] for name in LAYOUTS}
    for rnd in range(args.rounds + 1):
        for name in LAYOUTS:
            metas = metas_for(cp, args.seq, name != "ring-contig")
            idx = metas[rank].index
            ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
            fn = ulysses_attention if name == "ulysses" else ring_attention
            dist.barrier()
            comm_stats.reset()
            t0 = time.perf_counter()
            out = fn(ql, kl, vl, group, metas, scale=scale, kernel=args.kernel)
            t1 = time.perf_counter()
            fwd_bytes = comm_stats.forward_bytes
            out.backward(grad[:, :, idx])
            t2 = time.perf_counter()
            if rnd:
                runs[name].append({"forward_s": t1 - t0, "backward_s": t2 - t1, "compute_s": comm_stats.compute_s,
                                   "wait_s": comm_stats.wait_s, "forward_bytes": fwd_bytes,
                                   "backward_bytes": comm_stats.backward_bytes})
    _common.write_result(args, {"ranks": _common.gather(runs)})
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ report
def summarize(cp: int, data: dict, args) -> dict:
    """Per layout: the slowest rank's wall per round (min and median over rounds), per-rank compute and wait
    (min over rounds), bytes of rank 0."""
    out = {}
    for name in LAYOUTS:
        per_rank = [ranks[name] for ranks in data["ranks"]]  # [rank][round]
        rounds = range(len(per_rank[0]))
        walls = [max(r[i]["forward_s"] + r[i]["backward_s"] for r in per_rank) for i in rounds]
        compute = [min(x["compute_s"] for x in r) for r in per_rank]
        wait = [min(x["wait_s"] for x in r) for r in per_rank]
        first = per_rank[0][0]
        out[name] = {"wall_s": min(walls), "wall_median_s": statistics.median(walls), "compute_s": compute,
                     "wait_s": wait,
                     "forward_bytes": first["forward_bytes"], "backward_bytes": first["backward_bytes"]}
    return out


def ring_formula(args, cp: int) -> tuple[int, int]:
    shard = 2 * args.batch * args.kv_heads * (args.seq // cp) * args.head_dim  # K and V elements of one shard
    return (cp - 1) * shard * 4, (cp - 1) * shard * 4 + cp * shard * 4  # fp32 inputs here: e = 4


def report(args, results: dict) -> str:
    """results: {"cp": {cp: {"analytical", "isolated", "timed"}}, "single": {...}}."""
    by_cp, one = results["cp"], results["single"]
    lines = [f"causal attention, B={args.batch} Hq={args.heads} Hkv={args.kv_heads} S={args.seq} D={args.head_dim}, "
             f"fp32, kernel={args.kernel}, forward+backward", ""]
    lines.append("(a) balance: max/mean over ranks (1.00 = even)")
    lines.append(f"  {'cp':>3} {'shards':7} {'visible pairs':>14} {'computed pairs':>15} {'isolated CPU':>13} "
                 f"{'in-ring CPU':>12}   per-rank isolated CPU seconds")
    for cp, res in by_cp.items():
        for name, layout in (("contig", "ring-contig"), ("lb", "ring-lb")):
            a, iso, ring = res["analytical"][name], res["isolated"][name], res["timed"][layout]
            lines.append(f"  {cp:>3} {name:7} {ratio(a['visible']):14.2f} {ratio(a['computed']):15.2f} "
                         f"{ratio(iso):13.2f} {ratio(ring['compute_s']):12.2f}   "
                         + " ".join(f"{t:.2f}" for t in iso))
    lines += ["", "(b) bytes one rank sends per attention layer (fp32 K/V), counted in the P2P / all-to-all calls"]
    for cp, res in by_cp.items():
        fwd_f, bwd_f = ring_formula(args, cp)
        for layout in ("ring-lb", "ulysses"):
            t = res["timed"][layout]
            extra = (f"   ring formula {fwd_f} / {bwd_f}  (measured/formula {t['forward_bytes'] / fwd_f:.3f} / "
                     f"{t['backward_bytes'] / bwd_f:.3f})") if layout == "ring-lb" else ""
            lines.append(f"  cp={cp} {layout:8} forward {t['forward_bytes']:>10} backward {t['backward_bytes']:>10}"
                         + extra)
    lines += ["", "(c) forward+backward, min over rounds. one process: 1 thread on the whole sequence, "
              f"{one['wall_s']:.3f} s wall, {one['compute_s']:.3f} s block-math CPU"]
    lines.append(f"  {'cp':>3} {'layout':12} {'wall, slowest rank':>19} {'speed-up vs one':>16} "
                 f"{'block-math CPU, max rank':>25} {'sum over ranks / one':>21} {'wait, max rank':>15}")
    for cp, res in by_cp.items():
        for name in LAYOUTS:
            t = res["timed"][name]
            lines.append(f"  {cp:>3} {name:12} {t['wall_s']:18.3f}s {one['wall_s'] / t['wall_s']:16.2f} "
                         f"{max(t['compute_s']):24.3f}s {sum(t['compute_s']) / one['compute_s']:21.2f} "
                         f"{max(t['wait_s']):14.3f}s")
    for cp, res in by_cp.items():
        wall = {n: t["wall_s"] for n, t in res["timed"].items()}
        cpu = {n: max(t["compute_s"]) for n, t in res["timed"].items()}
        lines.append(f"  cp={cp}: ring-contig / ring-lb  wall {wall['ring-contig'] / wall['ring-lb']:.2f}, "
                     f"max-rank CPU {cpu['ring-contig'] / cpu['ring-lb']:.2f};  "
                     f"ulysses / ring-lb  wall {wall['ulysses'] / wall['ring-lb']:.2f}, "
                     f"max-rank CPU {cpu['ulysses'] / cpu['ring-lb']:.2f}")
    return "\n".join(lines)


def parent(args, argv) -> None:
    results = {"cp": {}}
    start, load_start = time.perf_counter(), os.getloadavg()
    for cp in args.cp:
        data = _common.launch_self(__file__, cp, argv, timeout=args.timeout)
        results["cp"][cp] = {"analytical": analytical(cp, args.seq), "isolated": isolated(args, cp),
                             "timed": summarize(cp, data, args)}
        print(f"[bench] cp={cp} done ({time.perf_counter() - start:.0f} s)", flush=True)
    results["single"] = single(args)
    print(f"\n[bench] {time.perf_counter() - start:.0f} s; load average at start {load_start[0]:.1f}, at end "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (times under load are upper bounds)\n")
    print(report(args, results))
    _common.write_json(args.json, results)


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
