"""How many ranks, on what, and starting them: shared by `nd-parallel demo` and `nd-parallel train`.

`parse_layout` reads the demo's layout names, `resolve_train_layout` a train YAML's layout (with `layout: auto` and
`lr_scaling`), `choose_ranks` picks the number of ranks and the device, and `run_job` starts them with torchrun and
reads back what rank 0 wrote. Under an outer launcher (torchrun, `accelerate launch`, SLURM) this process already
is a rank: nothing is started, it runs the job itself.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

from nd_parallel.config import RUN_OPTIONS, ConfigError, ParallelismConfig

from .train.job import Job, write_jobs

_TOKEN = re.compile(r"(ddp|fsdp|hsdp|tp|cp|pp)(\d*)(?:x(\d+))?")
_SIZE_OF = {"ddp": "dp_replicate_size", "fsdp": "dp_shard_size", "tp": "tp_size", "cp": "cp_size", "pp": "pp_size"}


def parse_layout(name: str) -> dict[str, int]:
    """ParallelismConfig kwargs of a layout name: '_'-joined ddpN, fsdpN (fsdp = the ranks left), hsdpRxS, tpN,
    cpN, ppN; e.g. fsdp2_tp2 -> dp_shard_size=2, tp_size=2."""
    kwargs: dict[str, int] = {}
    for token in name.split("_"):
        match = _TOKEN.fullmatch(token)
        kind, a, b = match.groups() if match else (None, "", None)
        if kind == "hsdp" and a and b:
            sizes = {"dp_replicate_size": int(a), "dp_shard_size": int(b)}
        elif kind in _SIZE_OF and b is None and (a or kind == "fsdp"):
            sizes = {_SIZE_OF[kind]: int(a) if a else -1}
        else:
            raise ConfigError(f"layout {name!r}: cannot read {token!r}; join ddpN, fsdpN, hsdpRxS, tpN, cpN, ppN "
                              "with '_', e.g. ddp2, fsdp2, hsdp2x2, tp2, fsdp2_tp2, hsdp2x2_tp2")
        if set(sizes) & set(kwargs):
            raise ConfigError(f"layout {name!r} sets {', '.join(sorted(set(sizes) & set(kwargs)))} twice")
        kwargs.update(sizes)
    return kwargs


def inside_launched_rank() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def main_rank() -> bool:
    """Whether this process prints: always, unless it is one of an outer launcher's ranks other than rank 0."""
    return not inside_launched_rank() or int(os.environ.get("RANK", "0")) == 0


def choose_ranks(config: ParallelismConfig, nproc: int | None, force_cpu: bool, cpu_fallback: bool, nnodes: int = 1):
    """(resolved config, number of ranks, "cuda" or "cpu"). GPUs are used when there are enough of them on this node
    for its share of the ranks (``nproc / nnodes``; every node runs as many)."""
    import torch

    if inside_launched_rank():
        return config.resolve(int(os.environ["WORLD_SIZE"])), int(os.environ["WORLD_SIZE"]), "launched"
    gpus = 0 if force_cpu else torch.cuda.device_count()
    if nproc is None and config.dp_shard_size == -1:  # "the ranks left over": every GPU, or 2-way on CPU
        others = math.prod(size for dim, size in config.sizes.items() if dim != "dp_shard")
        if not (gpus and gpus * nnodes % others == 0) and not cpu_fallback:
            raise ConfigError("dp_shard_size=-1 takes the ranks left over, so give the number of ranks: --nproc N")
        nproc = gpus * nnodes if gpus and gpus * nnodes % others == 0 else 2 * others
    nproc = nproc if nproc is not None else config.world_size
    config = config.resolve(nproc)
    if nproc % nnodes:
        raise ConfigError(f"{nproc} ranks do not split over --nnodes {nnodes}: every node starts the same number "
                          f"of ranks; use a layout (or --nproc) that is a multiple of {nnodes}")
    local = nproc // nnodes
    if gpus >= local:
        return config, nproc, "cuda"
    if gpus and not cpu_fallback:
        raise ConfigError(f"the layout needs {local} ranks per node but {gpus} GPU(s) are visible; pass --cpu to "
                          "train on CPU ranks, or use a layout with fewer ranks")
    if gpus:
        print(f"nd-parallel: {local} ranks do not fit {gpus} GPU(s); running on CPU ranks (gloo)")
    return config, nproc, "cpu"


def resolve_train_layout(cfg, path, nproc: int | None, cpu: bool, nnodes: int = 1):
    """(resolved layout, number of ranks, device) of a loaded train config; applies layout: auto and lr_scaling."""
    import torch

    if cfg.layout == "auto":  # the planner's top plan for the ranks launched (plan.py)
        from .plan import auto_train_layout

        nproc_auto = int(os.environ["WORLD_SIZE"]) if inside_launched_rank() else nproc
        use_cuda = not cpu and torch.cuda.is_available()
        planned, _ = auto_train_layout(cfg, path, nproc_auto, "cuda" if use_cuda else "cpu")
        # the planner chooses the layout; how the run reacts to faults stays what the YAML says
        cfg.parallel = dataclasses.replace(planned, **{k: getattr(cfg.parallel, k) for k in RUN_OPTIONS})
        cfg.parallel.plan = planned.plan
    if nproc is None and getattr(cfg, "use_ray", False) and not inside_launched_rank():  # Axolotl's Ray workers
        nproc = cfg.ray_num_workers or 1
    config, nproc, device = choose_ranks(cfg.parallel, nproc, cpu, cpu_fallback=False, nnodes=nnodes)
    if cfg.lr_scaling:
        from .plan import scaled_learning_rate

        cfg.learning_rate = scaled_learning_rate(
            cfg, path, cfg.micro_batch_size * cfg.gradient_accumulation_steps * config.dp_size)
    return config, nproc, device


def nodes_from_args(args):
    """``launch.Nodes`` for ``--nnodes N --rdzv-endpoint HOST:PORT`` (one `nd-parallel train` per node), else None."""
    from nd_parallel.fault.launch import Nodes

    if args.nnodes == 1:
        if args.rdzv_endpoint:
            raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint} without --nnodes: give the number of nodes, "
                              "e.g. --nnodes 2 (one nd-parallel train per node, each with the same endpoint)")
        return None
    if not args.rdzv_endpoint:
        raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node: the "
                          "address of the node that serves the rendezvous (e.g. the first node of the allocation)")
    if inside_launched_rank():
        raise ConfigError("--nnodes under an outer launcher: the launcher (torchrun, srun) already starts the "
                          "nodes; leave --nnodes and --rdzv-endpoint out")
    try:
        return Nodes(args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.rdzv_conf)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def run_job(job: Job, nproc: int, device: str, tmp: Path, timeout: float, max_restarts: int = 0,
            nodes=None) -> dict | None:
    """Every rank's results (rank 0's file), or None where rank 0 is not here: on the other ranks of an outer
    launcher, and on the other nodes of a multi-node launch (``nodes``: ``launch.Nodes``)."""
    import torch

    from nd_parallel.fault.launch import launch

    from .train import rank

    if device == "launched":
        return rank.run_rank(job)
    job = dataclasses.replace(job, results=str(tmp / "results.pt"))
    write_jobs(tmp / "job.json", [job])
    env = {}
    if job.quiet:
        env.update(TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONWARNINGS="ignore")
    if device == "cpu" and torch.cuda.is_available():
        env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="true")
    local = nproc // nodes.nnodes if nodes else nproc
    launch(rank.__name__, local, [str(tmp / "job.json")], timeout=timeout, env=env, max_restarts=max_restarts,
           nodes=nodes)
    if nodes and not os.path.isfile(job.results):  # rank 0 ran on another node, which prints the summary
        print(f"nd-parallel: this node's {local} ranks finished; the node that held rank 0 prints the summary")
        return None
    return torch.load(job.results, weights_only=True)
