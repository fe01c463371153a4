"""Step time and per-rank memory of FSDP2 x TP2 on 4 ranks, three ways, in one launch.

    ours          NDParallelPlugin(ParallelismConfig(dp_shard_size=2, tp_size=2)) attached to an Accelerator,
                  the unchanged Accelerate loop of nd_parallel/testing/parity.py (train_layout)
    transformers  AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2,
                  tp_size=2)) in a plain torch loop
    raw           hand-written torchtitan-style baseline: parallelize_module with Colwise/RowwiseParallel from
                  the model's tp_plan over mesh["tp"], then fully_shard per decoder layer + root over mesh["dp"]
                  of init_device_mesh("cpu", (2, 2), ("dp", "tp"))

All three train the same checkpoint on the same per-rank batches with the same recipe (AdamW, linear LR
decay, clipping at 1.0). Samples are full length (no padding), so every data-parallel rank holds the same
number of label tokens: the global-token mean (ours) and the mean of per-rank means (the baselines) are
then the same loss with the same gradient, and the three runs must agree step by step.

The implementations alternate in rounds (A B C A B C ...) so that load from other work on the machine hits
them alike; warm-up steps are discarded. See docs/benchmarks.md for what each number means.

    python benchmarks/bench_fsdp_tp.py            # hidden 256, 4 layers, intermediate 1024, seq 128
    python benchmarks/bench_fsdp_tp.py --quick    # smoke run: a tiny model, a few steps
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import _common
import torch
import torch.distributed as dist
from bench_report import DP, IMPLS, PHASES, TP, report
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.utils import clip_grads_with_norm_, get_total_norm
from torch.utils.data import DataLoader


# --------------------------------------------------------------------------------------------- arguments
def parse_args(argv):
    p = _common.parser(__doc__)
    _common.flags(p, steps=(3, "timed steps per implementation per round [3]"), rounds=(10, "rounds of A B C [10]"),
                  warmup=(3, "untimed steps per implementation before round 1 [3]"),
                  family=("llama", "nd_parallel.testing.models family [llama]"),
                  tied=(False, "tie embeddings and lm_head [untied]"), hidden=256, intermediate=1024, layers=4,
                  heads=8, kv_heads=4, seq=128, batch=(2, "samples per data-parallel rank per step [2]"),
                  profile=(False, ("after the rounds, profile one more step per implementation and count its "
                                   "collectives")),
                  sp=("auto", "ours' sequence_parallel: auto, on or off [auto]"),
                  loss_chunk=("auto", "ours' loss_chunk_size: auto, or tokens per chunk, 0 = HF's loss [auto]"))
    quick = {"steps": 2, "rounds": 2, "warmup": 1, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4,
             "kv_heads": 2, "seq": 32}
    args = _common.parse(p, argv, quick=quick,
                         quick_help="smoke run: tiny model, 1 warm-up step, 2 rounds of 2",
                         json_help="also write the raw results (per-step times, losses, bytes) to this file",
                         timeout=1800, internal=("--model-dir",))
    if args.hidden % args.heads or args.heads % TP or args.kv_heads % TP:
        p.error(f"--hidden {args.hidden} --heads {args.heads} --kv-heads {args.kv_heads}: the heads must divide "
                f"the hidden size, and tp={TP} must divide both head counts")
    if min(args.steps, args.rounds, args.warmup) < 1:
        p.error("--steps, --rounds and --warmup must be at least 1 (the first warm-up step is the sanity step)")
    return args


def model_overrides(args) -> dict:
    return dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=args.hidden // args.heads, max_position_embeddings=max(256, args.seq),
                tie_word_embeddings=args.tied)


def total_steps(args) -> int:
    # + 1 untimed step that measures memory, + 1 profiled step with --profile
    return args.warmup + args.rounds * args.steps + 1 + int(args.profile)


# ------------------------------------------------------------------------------------ one implementation
@dataclass
class Impl:
    """A model prepared by one implementation and the loop pieces it trains with."""

    name: str
    model: Any
    optimizer: Any  # what the loop calls step()/zero_grad() on (Accelerate's wrapper for ours)
    scheduler: Any
    loader: Any
    backward: Callable
    clip: Callable  # () -> total grad norm
    loss_is_global: bool  # ours: out.loss is already the global-token mean, the same on every rank
    times: list = field(default_factory=list)  # per step: {phase: wall seconds}
    cpu: list = field(default_factory=list)  # per step: CPU seconds of this rank's process, all its threads
    record: list = field(default_factory=list)  # per step: (loss, label tokens, grad norm) on this rank
    first_ids: Any = None

    def __post_init__(self):
        self._it = iter(self.loader)

    def _next_batch(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)

    def step(self, measure: Callable | None = None) -> None:
        """One training step, the loop of train_layout; wall time per phase, CPU time in total."""
        c0, t0 = time.process_time(), time.perf_counter()
        batch = self._next_batch()
        t1 = time.perf_counter()
        out = self.model(**batch)
        t2 = time.perf_counter()
        self.backward(out.loss)
        t3 = time.perf_counter()
        norm = self.clip()
        t4 = time.perf_counter()
        self.optimizer.step()
        self.scheduler.step()
        if measure is not None:  # the only point where gradients and optimizer state both exist
            measure(self)
        self.optimizer.zero_grad()
        loss = out.loss.item()
        t5 = time.perf_counter()
        self.times.append(dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4))))
        self.cpu.append(time.process_time() - c0)
        self.record.append((loss, int((batch["labels"][..., 1:] != -100).sum()), float(norm)))
        if self.first_ids is None:
            self.first_ids = batch["input_ids"].clone()


def _collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def _optimizer_and_schedule(model, steps: int):
    """parity.py's recipe: AdamW lr 1e-3, weight decay 0.01, LR decaying linearly to half. torch's default eps
    (parity.py uses 1e-6 to tame reduction-order noise in its comparisons; the work per step is the same)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * steps))
    return opt, sched


def _dp_loader(samples, dp_rank: int, batch: int) -> DataLoader:
    """This data-parallel rank's batches in the order Accelerate hands them out: batch k of the unsharded
    loader goes to dp rank k % DP, so dp rank r's step s is batch s * DP + r."""
    n_batches = len(samples) // batch
    mine = [list(range(k * batch, (k + 1) * batch)) for k in range(dp_rank, n_batches, DP)]
    return DataLoader(samples, batch_sampler=mine, collate_fn=_collate)


def clip_per_mesh(parameters, max_norm: float) -> torch.Tensor:
    """Global grad-norm clipping when gradients live on different meshes (the norms' weights are FSDP-only,
    on the 1-D dp mesh; the TP weights are on the 2-D mesh; torch's clip_grad_norm_ refuses to stack norms
    across meshes): one norm per mesh, made whole with full_tensor(), then combined. transformers' Trainer
    does the same for models sharded by DistributedConfig."""
    by_mesh = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for params in by_mesh.values():
        norm = get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in by_mesh.values():
        clip_grads_with_norm_(params, max_norm, total)
    return total


# ------------------------------------------------------------------------------ the three implementations
def build_ours(accelerator, model_dir, samples, args) -> Impl:
    from nd_parallel import NDParallelPlugin, ParallelismConfig

    sp = {"auto": "auto", "on": True, "off": False}[args.sp]
    chunk = args.loss_chunk if args.loss_chunk == "auto" else int(args.loss_chunk)
    config = ParallelismConfig(dp_shard_size=DP, tp_size=TP, sequence_parallel=sp, loss_chunk_size=chunk)
    plugin = NDParallelPlugin(config).attach(accelerator)
    model = plugin.from_pretrained(model_dir, attn_implementation="sdpa")
    opt, sched = _optimizer_and_schedule(model, total_steps(args))
    loader = DataLoader(samples, batch_size=args.batch, collate_fn=_collate)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    model.train()
    return Impl("ours", model, opt, sched, loader, backward=accelerator.backward,
                clip=lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0), loss_is_global=True)


def build_transformers(model_dir, samples, args, dp_rank: int) -> Impl:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    # Builds its own (pp, dp_replicate, fsdp, tp) mesh on the already initialised gloo group, installs its own
    # TP layers, then fully_shard from the model's fsdp plan, and loads each rank's slices.
    config = DistributedConfig(fsdp_size=DP, tp_size=TP)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", distributed_config=config)
    model.train()
    opt, sched = _optimizer_and_schedule(model, total_steps(args))
    return Impl("transformers", model, opt, sched, _dp_loader(samples, dp_rank, args.batch),
                backward=lambda loss: loss.backward(), clip=lambda: clip_per_mesh(model.parameters(), 1.0),
                loss_is_global=False)


RAW_STYLES = {  # the HF plan styles of a dense decoder -> the torch ParallelStyle with the same layouts
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def build_raw(model_dir, samples, args, dp_rank: int) -> Impl:
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    unknown = {s for s in model.tp_plan.values() if s not in RAW_STYLES}
    if unknown:
        raise NotImplementedError(f"the raw baseline maps only {sorted(RAW_STYLES)}, not {sorted(unknown)}")
    # parallelize_module matches the plan's "*" itself (fnmatch per name segment).
    parallelize_module(model, mesh["tp"], {name: RAW_STYLES[s]() for name, s in model.tp_plan.items()})
    if model.config.tie_word_embeddings:  # TP made two parameters out of the shared one: share it again
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.train()
    opt, sched = _optimizer_and_schedule(model, total_steps(args))
    return Impl("raw", model, opt, sched, _dp_loader(samples, dp_rank, args.batch),
                backward=lambda loss: loss.backward(), clip=lambda: clip_per_mesh(model.parameters(), 1.0),
                loss_is_global=False)


# -------------------------------------------------------------------------------------------- measuring
def state_bytes(impl: Impl) -> dict[str, int]:
    """This rank's params, grads and optimizer state in bytes, two ways. ``params/grads/optim``: the storages
    behind the local tensors, each storage once (a flat buffer that several gradients view counts once, with
    its padding; a shard that is a view into a larger tensor counts that whole tensor, which is what stays
    allocated). ``logical``: only the elements of the local tensors."""
    seen: set[int] = set()
    logical = 0

    def nbytes(tensors) -> int:
        nonlocal logical
        total = 0
        for t in tensors:
            t = t.to_local() if isinstance(t, DTensor) else t
            logical += t.numel() * t.element_size()
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(impl.model.parameters())
    opt = getattr(impl.optimizer, "optimizer", impl.optimizer)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {"params": nbytes(params), "grads": nbytes(p.grad for p in params if p.grad is not None),
           "optim": nbytes(state)}
    return {**out, "logical": logical}


def scalar_allreduce_latency(group, n: int = 40) -> float:
    """Median wall time of one blocking all-reduce of a scalar over ``group``: the price of each of the two
    loss collectives that ours adds per step (the token count, then the loss value)."""
    x = torch.ones(())
    dist.barrier()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        dist.all_reduce(x, group=group)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def count_collectives(impl: Impl) -> dict[str, int]:
    """Collective calls of one training step, from torch.profiler's CPU events (c10d ops and gloo's own)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        impl.step()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith(("c10d::", "gloo:"))}


def run_steps(impl: Impl, n: int, measure=None) -> None:
    dist.barrier()  # every rank starts the block together; the barrier is not timed
    for _ in range(n):
        impl.step(measure)


def collect(impls: list[Impl], measured: dict) -> dict:
    """Every rank's timings, losses and bytes on every rank. A step's wall time is the slowest rank's; its
    CPU time is the sum over ranks (the work of all of them together)."""
    out = {}
    for impl in impls:
        rec = torch.tensor(impl.record, dtype=torch.float64)  # [steps, (loss, tokens, norm)]
        if not impl.loss_is_global:  # this rank's mean -> the global-token mean that ours reports
            pair = torch.stack([rec[:, 0] * rec[:, 1], rec[:, 1]])
            dist.all_reduce(pair)  # tp peers hold equal numbers, so they cancel in the ratio
            rec[:, 0] = pair[0] / pair[1]
        gathered = _common.gather({"times": impl.times, "cpu": impl.cpu, "bytes": measured[impl.name],
                                   "ids": impl.first_ids})
        steps = range(len(impl.times))
        out[impl.name] = {
            "times": [{ph: max(g["times"][s][ph] for g in gathered) for ph in PHASES} for s in steps],
            "wall": [max(sum(g["times"][s].values()) for g in gathered) for s in steps],
            "cpu": [sum(g["cpu"][s] for g in gathered) for s in steps],
            "losses": rec[:, 0].tolist(),
            "norms": rec[:, 2].tolist(),
            "bytes": [g["bytes"] for g in gathered],
            "ids": [g["ids"] for g in gathered],
        }
    reference = out["ours"]["ids"]
    for name in IMPLS:  # the same first batch on every rank for every implementation
        out[name]["same_first_batch"] = all(torch.equal(a, b) for a, b in zip(out[name].pop("ids"), reference))
    return out


# ------------------------------------------------------------------------------------------------ ranks
def worker(args) -> None:
    from accelerate import Accelerator

    from nd_parallel.testing.models import make_samples

    _quiet()
    load_at_start = _common.loadavg()
    accelerator = Accelerator()  # the launcher sets ACCELERATE_USE_CPU: gloo ranks on a CPU machine
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != DP * TP:
        raise SystemExit(f"this benchmark needs {DP * TP} ranks, got {world}")
    dp_rank = rank // TP  # every mesh here is (dp, tp) in row-major order: tp peers are neighbours
    samples = make_samples(total_steps(args) * args.batch * DP, args.seq, seed=0, min_len=args.seq)
    impls = [build_ours(accelerator, args.model_dir, samples, args),
             build_transformers(args.model_dir, samples, args, dp_rank),
             build_raw(args.model_dir, samples, args, dp_rank)]
    for impl in impls:
        run_steps(impl, args.warmup)
    for r in range(args.rounds):
        for impl in impls:
            run_steps(impl, args.steps)
        if rank == 0:
            print(f"[bench] round {r + 1}/{args.rounds} done", flush=True)
    measured = {}
    for impl in impls:
        run_steps(impl, 1, measure=lambda i: measured.setdefault(i.name, state_bytes(i)))
    latency = scalar_allreduce_latency(accelerator.nd_parallel.mesh["dp_cp"].get_group())
    profiles = {impl.name: count_collectives(impl) for impl in impls} if args.profile else None
    result = collect(impls, measured)
    result["collectives"] = profiles
    if rank == 0:
        result["meta"] = {**_common.machine(), "n_params": _n_params(args.model_dir), "loadavg_start": load_at_start,
                          "loadavg_end": _common.loadavg(), "allreduce_latency": latency,
                          "args": {k: v for k, v in vars(args).items() if k not in ("model_dir", "result", "worker")}}
    _common.write_result(args, result)
    dist.barrier()
    dist.destroy_process_group()


def _n_params(model_dir) -> int:
    """The unsharded model's parameter count, from a meta-device copy (no memory, no loading)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def _quiet() -> None:
    """Silence messages that repeat on every rank and step and say nothing about speed."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2 on HF module outputs
    # DTensor notes that a 2-D norm reduction takes two all-reduces (the baselines' clipping): that cost is
    # part of what is measured here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    _common.quiet_transformers()


# ---------------------------------------------------------------------------------------------- launcher
def parent(args, argv) -> None:
    from nd_parallel.testing.models import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench_fsdp_tp_") as tmp:
        model_dir = save_tiny_model(args.family, Path(tmp) / "model", seed=0, **model_overrides(args))
        result, took = _common.launch_timed(__file__, DP * TP, [*argv, "--model-dir", str(model_dir)],
                                            timeout=args.timeout)
    print(f"\n[bench] launch took {took}\n")
    print(report(result, args))
    _common.write_json(args.json, result)


if __name__ == "__main__":
    sys.exit(_common.run(parse_args, worker, parent))
