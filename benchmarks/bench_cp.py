"""Context parallelism at the model level, in one launch of cp ranks: activation memory and step time.

1. Saved activations: bytes autograd keeps for backward during one training forward, per rank, for
   - one process at sequence S (the baseline),
   - cp ranks at sequence S*cp under cp_size=cp (each rank holds S tokens), and
   - one process at S*cp (what CP saves you from).
   Counted with torch.autograd.graph.saved_tensors_hooks over unique storages, leaving out the weights
   (tensors shaped like a parameter). With CP the per-rank bytes should stay ~flat as the sequence grows with
   the number of ranks: the ring kernel keeps q, k, v, out and log-sum-exp of the local shard only.
2. Step time (forward + backward + AdamW step) at sequence --seq with batch 1: CP over the cp ranks vs one
   process on the same sequence (rank 0 alone while the others wait), with 1 thread and with cp threads. The
   runs alternate step by step; warm-up steps are discarded.

    python benchmarks/bench_cp.py                  # cp=2, llama hidden 256, 4 layers, seq 4096
    python benchmarks/bench_cp.py --quick          # smoke run
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch


def saved_bytes(model, batch, skip_shapes) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (weights left out)."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and tuple(t.shape) not in skip_shapes:
            local = t.to_local() if hasattr(t, "to_local") else t
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.testing.models import make_samples

    accelerator = Accelerator()
    rank, cp = dist.get_rank(), dist.get_world_size()

    def batch_of(seq):
        sample = make_samples(1, seq, min_len=seq)[0]
        return {k: v[None] for k, v in sample.items()}

    single = AutoModelForCausalLM.from_pretrained(args.model) if rank == 0 else None
    skip = {tuple(p.shape) for p in AutoModelForCausalLM.from_pretrained(args.model).parameters()}
    plugin = NDParallelPlugin(ParallelismConfig(cp_size=cp, cp_backend=args.backend)).attach(accelerator)
    model = plugin.from_pretrained(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = accelerator.prepare(model, opt)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-4) if single is not None else None

    mem_seq = args.mem_seq
    memory = {}
    if rank == 0:
        memory["single_S"] = saved_bytes(single, batch_of(mem_seq), skip)
        memory["single_S_cp"] = saved_bytes(single, batch_of(mem_seq * cp), skip)
    dist.barrier()
    cp_bytes = saved_bytes(model, batch_of(mem_seq * cp), skip)
    per_rank = [None] * cp
    dist.all_gather_object(per_rank, cp_bytes)
    memory["cp_per_rank"] = per_rank

    batch = batch_of(args.seq)
    times = {"cp": [], "single_1thread": [], f"single_{cp}threads": []}
    for _ in range(args.steps):
        for name in times:
            dist.barrier()
            start = time.perf_counter()
            if name == "cp":
                out = model(**batch)
                accelerator.backward(out.loss)
                opt.step()
                opt.zero_grad()
            elif rank == 0:
                torch.set_num_threads(1 if name == "single_1thread" else cp)
                loss = single(**batch).loss
                loss.backward()
                single_opt.step()
                single_opt.zero_grad()
                torch.set_num_threads(1)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    _common.write_result(args, {"memory": memory, "times": times, "cp": cp})


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, cp=2)
    p.add_argument("--backend", default="ring", choices=["ring", "ulysses"])
    _common.flags(p, seq=(4096, "sequence of the step-time comparison [4096]"),
                  mem_seq=(1024, "S of the memory comparison [1024]"), hidden=256, layers=4, steps=5, warmup=1)
    return _common.parse(p, argv, quick={"hidden": 64, "layers": 2, "seq": 256, "mem_seq": 128, "steps": 3},
                         internal=("--model",))


def parent(args, argv) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = _common.save_llama(Path(tmp) / "model", args.hidden, args.layers, heads=8,
                                   max_position_embeddings=max(args.seq, args.mem_seq * args.cp))
        forwarded = [f"--seq={args.seq}", f"--mem-seq={args.mem_seq}", f"--steps={args.steps}",
                     f"--backend={args.backend}", f"--model={model}"]
        data = _common.launch_self(__file__, args.cp, forwarded, timeout=3000, capture=True)
    cp, mem = data["cp"], data["memory"]
    mib = 2.0**20
    print(f"llama hidden={args.hidden} layers={args.layers} heads 8/4, cp={cp} backend={args.backend}")
    print(f"saved activations per rank (MiB): one process at S={args.mem_seq}: {mem['single_S'] / mib:.1f}; "
          f"one process at S*cp={args.mem_seq * cp}: {mem['single_S_cp'] / mib:.1f}; "
          f"CP ranks at S*cp: {', '.join(f'{b / mib:.1f}' for b in mem['cp_per_rank'])}")
    print(f"ratio CP rank max / one process at S: {max(mem['cp_per_rank']) / mem['single_S']:.3f}; "
          f"CP rank max / one process at S*cp: {max(mem['cp_per_rank']) / mem['single_S_cp']:.3f}")
    med = {k: statistics.median(v[args.warmup:]) for k, v in data["times"].items()}
    print(f"step time at seq {args.seq}, batch 1 (median of {args.steps - args.warmup}, alternating):")
    for name, value in med.items():
        print(f"  {name:<18} {value * 1e3:9.1f} ms")
    for name in med:
        if name != "cp":
            print(f"speed-up CP{cp} vs {name}: {med[name] / med['cp']:.2f}x")


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
