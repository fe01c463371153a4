"""Activation checkpointing: saved-activation bytes and step time with none / selective / full, per layout.

For each layout (one process, FSDP2, TP2, PP2, CP2 on 2 ranks) and each mode, one launch trains a Llama-shaped
model at a sequence long enough that activations dominate (default hidden 256, 4 layers, seq 1024, fp32):

- **held bytes**: tensor storage created during one training forward and still alive when it returns (what
  autograd keeps for backward: saved activations, checkpointed layer inputs, the loss), counted by a dispatch
  mode over storages, leaving out parameters (FSDP's unsharded root). Max over ranks. Not for PP, whose
  forward call runs the backward too.
- **peak activation bytes**: peak live tensor bytes during forward + backward of the second step minus what was
  alive before it (parameters, gradients kept allocated by zero_grad(set_to_none=False), optimizer state), with the planner's allocator-level tracker
  (nd_parallel/planner/measure.py). This one covers PP (1F1B keeps up to pp micro-batches in flight on stage 0).
  Under "selective" with CP the ring runs with dispatch modes off (context_parallel/hf.py), so its transient
  buffers are not seen by the tracker; its saved outputs are recomputed anyway.
- **step time**: forward + backward + AdamW step, median over the timed steps, slowest rank. The modes
  alternate step by step inside one launch, so machine noise hits them alike. The bytes above are measured in a
  step of their own, before the timed ones: no timed step runs under a dispatch mode.

The formula to compare with: "full" keeps each layer's input, ~2·s·b·h bytes per layer in bf16 (4·s·b·h in
fp32 here), plus the embedding output, final norm and logits.

    python benchmarks/bench_activation_checkpointing.py            # seq 1024, 3 timed steps per mode
    python benchmarks/bench_activation_checkpointing.py --quick    # smoke run (seq 256)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import _common
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MODES = (None, "selective", "full")
LAYOUTS = {"one": (1, {}), "fsdp2": (2, dict(dp_shard_size=2)), "tp2": (2, dict(tp_size=2)),
           "pp2": (2, dict(pp_size=2, pp_microbatches=2)), "cp2": (2, dict(cp_size=2))}


class HeldAfterForward(TorchDispatchMode):
    """Storages that ops return during a forward, each counted once; ``held()`` sums those still alive."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.layout == torch.strided:
                # The storage, not the tensor: selective checkpointing keeps a detached alias of an op's output,
                # whose storage outlives the tensor object the op returned.
                try:
                    st = t.untyped_storage()
                    self.refs.setdefault(id(st), (weakref.ref(st), st.data_ptr()))
                except RuntimeError:  # a wrapper without data of its own (e.g. an async collective's result)
                    continue
        return out

    def held(self, exclude_ptrs: set[int]) -> int:
        total, seen = 0, set()
        for ref, ptr in self.refs.values():
            st = ref()
            if st is None or ptr in exclude_ptrs or ptr in seen or not _valid(st):
                continue
            seen.add(ptr)
            total += st.nbytes()
        return total


def _valid(st) -> bool:
    try:
        st.data_ptr()
        return True
    except RuntimeError:
        return False


def _param_ptrs(model) -> set[int]:
    ptrs = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        ptrs.add(local.untyped_storage().data_ptr())
    return ptrs


def worker(args) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    from nd_parallel import NDParallelPlugin, ParallelismConfig
    from nd_parallel.testing.models import make_samples
    from nd_parallel.testing.parity import _collate

    layout = json.loads(args.layout)
    samples = make_samples(n=4, seq_len=args.seq, min_len=args.seq)
    runs = {}
    for mode in MODES:
        AcceleratorState._reset_state(reset_partial_state=False)
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout, activation_checkpointing=mode)).attach(accelerator)
        model = plugin.from_pretrained(args.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        per_rank = 2 if layout.get("pp_size", 1) > 1 else 1
        loader = DataLoader(samples, batch_size=per_rank, collate_fn=_collate)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        runs[mode] = (accelerator, model, opt, next(iter(loader)))
    from nd_parallel.planner.measure import LiveTensorBytes, state_tensors

    held, peaks, times = {}, {}, {m: [] for m in MODES}
    # warm-up steps, then the one instrumented step (after a step, so gradients exist and count as state), then
    # the timed steps: no timed step runs under the dispatch modes, which slow every op down
    measured_at = max(1, args.warmup)
    for step in range(measured_at + 1 + args.steps):
        for mode, (accelerator, model, opt, batch) in runs.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            if step == measured_at:
                peak = LiveTensorBytes(state_tensors(model, opt))
                before = peak.current
                with peak:
                    tracker = HeldAfterForward()
                    with tracker:
                        out = model(**batch)
                    held[mode] = tracker.held(_param_ptrs(model))
                    accelerator.backward(out.loss)
                peaks[mode] = peak.peak - before
            else:
                out = model(**batch)
                accelerator.backward(out.loss)
            opt.step()
            opt.zero_grad(set_to_none=False)  # gradients stay allocated: the peak below is activations, not grads
            out.loss.item()
            if step > measured_at:
                times[mode].append(time.perf_counter() - start)
    medians = {str(m): statistics.median(t) for m, t in times.items()}
    every = _common.gather({"held": held, "peak": peaks, "time": medians})
    _common.write_result(args, {"held": {str(m): max(r["held"][m] for r in every) for m in MODES},
                                "peak": {str(m): max(r["peak"][m] for r in every) for m in MODES},
                                "time": {str(m): max(r["time"][str(m)] for r in every) for m in MODES}})


def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, seq=1024, hidden=256, layers=4, steps=3, warmup=1, layouts=",".join(LAYOUTS))
    return _common.parse(p, argv, quick={"seq": 256, "steps": 1}, internal=("--layout", "--model"))


def parent(args, argv) -> None:
    h = args.hidden
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = _common.save_llama(Path(tmp) / "m", h, args.layers, heads=8,
                                   max_position_embeddings=max(4096, args.seq))
        for name in args.layouts.split(","):
            world, layout = LAYOUTS[name]
            print(f"-- {name} ({world} rank(s))", file=sys.stderr, flush=True)
            res = _common.launch_self(__file__, world, [f"--seq={args.seq}", f"--steps={args.steps}",
                                                         f"--warmup={args.warmup}", f"--layout={json.dumps(layout)}",
                                                         f"--model={model}"], timeout=1800)
            rows.append((name, res))
    per_layer_full = 4 * args.seq * h  # fp32 input of one layer, batch 1 (per micro-batch)
    print(f"\nllama h={h}, {args.layers} layers, seq {args.seq}, fp32; 'full' formula: 4*s*b*h = "
          f"{per_layer_full / 2**20:.2f} MiB per layer input\n")
    print("\n".join(_common.md_table(HEAD, [table_row(name, res) for name, res in rows])))
    print("\nraw:", json.dumps(rows))


HEAD = ["layout", "peak none (MiB)", "selective", "full", "selective / none", "full / none",
        "held after fwd: selective / none", "full / none", "time selective / none", "time full / none"]


def table_row(name: str, res: dict) -> list[str]:
    p_none, p_sel, p_full = (res["peak"][str(m)] / 2**20 for m in MODES)
    h_none, h_sel, h_full = (res["held"][str(m)] for m in MODES)
    held = [f"{h_sel / h_none:.2f}", f"{h_full / h_none:.2f}"] if name != "pp2" else ["n/a", "n/a"]
    t_none, t_sel, t_full = (res["time"][str(m)] for m in MODES)
    return [name, f"{p_none:.1f}", f"{p_sel:.1f}", f"{p_full:.1f}", f"{p_sel / p_none:.2f}", f"{p_full / p_none:.2f}",
            *held, f"{t_sel / t_none:.2f}x", f"{t_full / t_none:.2f}x"]


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
