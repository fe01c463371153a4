"""A MoE model (8 experts, top 2) on 4 ranks under FSDP4, EP2 x FSDP2, EP4 and TP2 x EP2, in one launch, side by side.

For each layout:
    state     model-state bytes per rank (parameters + gradients + AdamW moments this rank holds, fp32), against
              the ideal: the whole model's state divided by the 4 ranks
    a2a       bytes the expert all-to-alls move per step on this rank (counted in the dispatch), against the
              formula tokens x top-k x hidden x 4 bytes x 2 directions (forward; backward moves the same again)
    step      median step time, and its ratio to FSDP4's
Under TP2 x EP2 the experts are split over ep only and whole on both tp ranks (torchtitan's etp=1), so its state is
above the ideal by design: the experts' share is divided by 2 ranks, not 4. The layouts alternate in rounds so
that load from other work hits them alike.

    python benchmarks/bench_moe.py            # hidden 256, 8 experts of intermediate 512, 2 layers, seq 128
    python benchmarks/bench_moe.py --quick    # smoke run: hidden 64, 2 rounds
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import _common
import torch
from torch.utils.data import DataLoader

LAYOUTS = {"fsdp4": dict(dp_shard_size=4), "ep2_fsdp2": dict(dp_shard_size=4, ep_size=2),
           "ep4": dict(dp_shard_size=4, ep_size=4), "tp2_ep2": dict(dp_shard_size=2, tp_size=2, ep_size=2)}
WORLD = 4


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, hidden=256, intermediate=512, layers=2, experts=8, top_k=2, seq=128,
                  batch=(2, "samples per rank per step [2]"), rounds=(5, "rounds over the layouts [5]"),
                  steps=(2, "timed steps per layout per round [2]"))
    return _common.parse(p, argv, quick={"hidden": 64, "intermediate": 128, "seq": 32, "rounds": 2},
                         quick_help="smoke run: a tiny model, 2 rounds", json_help="also write the raw numbers",
                         timeout=1800, internal=("--model-dir",))


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model, opt) -> int:
    optimizer = getattr(opt, "optimizer", opt)
    params = list({id(p): p for p in model.parameters()}.values())
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    # A gradient is as large as its parameter (counted so, since zero_grad frees them between steps).
    return sum(_local_bytes(p) for p in params) * 2 + sum(_local_bytes(m) for m in moments)


def worker(args) -> None:
    from accelerate import Accelerator

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.distributed.expert_parallel import dispatch
    from nd_parallel.testing.models import make_samples

    _common.quiet_transformers()
    moved = {"bytes": 0}
    exchange = dispatch._exchange

    def counting(x, out_splits, in_splits, group):  # rows sent to the other ranks of the ep group
        if x.dim() == 2:
            rank = torch.distributed.get_rank(group)
            moved["bytes"] += (sum(in_splits) - in_splits[rank]) * x.shape[1] * x.element_size()
        return exchange(x, out_splits, in_splits, group)

    dispatch._exchange = counting
    samples = make_samples(n=WORLD * args.batch * (2 + args.rounds * args.steps), seq_len=args.seq, min_len=args.seq)
    runs = {}
    for name, sizes in LAYOUTS.items():
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**sizes)).attach(accelerator)
        model = plugin.from_pretrained(args.model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = DataLoader(samples, batch_size=args.batch,
                            collate_fn=lambda s: {k: torch.stack([x[k] for x in s]) for k in s[0]})
        model, opt, loader = accelerator.prepare(model, opt, loader)
        runs[name] = {"acc": accelerator, "model": model, "opt": opt, "it": iter(loader), "times": [], "a2a": []}

    def step(run):
        batch = next(run["it"])
        moved["bytes"] = 0
        start = time.perf_counter()
        out = run["model"](**batch)
        run["acc"].backward(out.loss)
        run["opt"].step()
        run["opt"].zero_grad()
        torch.distributed.barrier()
        run["times"].append(time.perf_counter() - start)
        run["a2a"].append(moved["bytes"])

    for run in runs.values():  # warm-up, untimed; AdamW's moments exist afterwards
        step(run)
        run["times"].clear()
        run["a2a"].clear()
    for _ in range(args.rounds):
        for run in runs.values():
            for _ in range(args.steps):
                step(run)
    result = {name: {"state": _common.gather(state_bytes(r["model"], r["opt"])),
                     "a2a": _common.gather(statistics.median(r["a2a"])),
                     "step_s": statistics.median(r["times"])} for name, r in runs.items()}
    _common.write_result(args, result)


def parent(args, argv) -> None:
    from nd_parallel.testing.models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model("mixtral", tmp, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                    num_hidden_layers=args.layers, num_local_experts=args.experts,
                                    num_experts_per_tok=args.top_k, head_dim=args.hidden // 4,
                                    max_position_embeddings=max(256, args.seq))
        total = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(
            model_dir).parameters())
        result, took = _common.launch_timed(__file__, WORLD, [*argv, "--model-dir", str(model_dir)],
                                            timeout=args.timeout, capture=True)
    ideal = total * 4 * 4 / WORLD  # fp32 params, grads, two AdamW moments, split over the ranks
    # Every (token, slot) pair of a rank goes out and comes back; a fraction (ep-1)/ep of them to another rank
    # when routing is uniform.
    tokens = args.batch * args.seq
    formula = tokens * args.top_k * args.hidden * 4 * 2
    base = result["fsdp4"]["step_s"]
    rows = []
    for name, r in result.items():
        ep = LAYOUTS[name].get("ep_size", 1)
        remote = formula * (ep - 1) / ep
        a2a = statistics.mean(r["a2a"])  # every MoE layer's dispatch and combine, this step's forward
        rows.append([name, f"{max(r['state']) / 2**20:.2f}", f"{max(r['state']) / ideal:.2f}",
                     f"{a2a / 2**10:.1f}", f"{remote * args.layers / 2**10:.1f}",
                     f"{a2a / (remote * args.layers):.2f}" if ep > 1 else "-",
                     f"{r['step_s'] * 1e3:.0f}", f"{r['step_s'] / base:.2f}"])
    print(f"mixtral, {args.experts} experts top {args.top_k}, hidden {args.hidden}, {args.layers} layers, seq "
          f"{args.seq}, {args.batch} samples per rank; {WORLD} gloo ranks; launch took {took}; load {_common.loadavg()}")
    print("\n".join(_common.md_table(
        ["layout", "state MiB/rank (max)", "x ideal", "a2a KiB/step/rank (fwd)", "formula KiB (remote share)",
         "ratio", "step ms", "x fsdp4"], rows)))
    _common.write_json(args.json, {"result": result, "total_params": total, "machine": _common.machine()})


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
