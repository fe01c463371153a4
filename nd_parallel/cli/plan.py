"""`nd-parallel plan MODEL ...`: rank every layout of a cluster for a model, from the model's meta-device build.

Also the `layout: auto` and `lr_scaling` keys of `nd-parallel train` (`auto_train_layout`).
"""

from __future__ import annotations

import json
import sys

from nd_parallel.planner import (
    CHECKPOINTING,
    PP_SCHEDULES,
    Cluster,
    Constraints,
    Layout,
    PlannerError,
    Training,
    UnitError,
    load_config,
    parse_bandwidth,
    parse_bytes,
    parse_flops,
    plan,
    scale_lr,
    spec_from_path,
    table,
    to_json,
    yaml_blocks,
)

PINS = {"dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard", "tp": "--tp", "cp": "--cp", "pp": "--pp",
        "ep": "--ep"}


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="rank the layouts of a cluster for a model: memory and step time predicted",
                          description=__doc__.splitlines()[0])
    plan.add_argument("model", help="local checkpoint directory or config.json (no weights are read)")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--gpu-memory", default="80GiB", help="usable memory per GPU (80GiB, 40GB, ...)")
    plan.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    plan.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step, all ranks")
    plan.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                      help="bf16: mixed precision (fp32 master weights and AdamW); fp32: everything fp32")
    plan.add_argument("--lora-rank", type=int, help="train a LoRA adapter of this rank on a frozen base")
    plan.add_argument("--lora-targets", help="comma-separated Linear names to adapt (default: every Linear)")
    plan.add_argument("--intra-bw", default="400GB/s", help="per-GPU bandwidth inside a node")
    plan.add_argument("--inter-bw", default="50GB/s", help="per-GPU bandwidth across nodes")
    plan.add_argument("--gpu-flops", default="989TFLOPS", help="peak dense FLOP/s at the compute dtype")
    plan.add_argument("--efficiency", type=float, default=0.45, help="fraction of the peak matmuls reach")
    plan.add_argument("--mem-bw", default="3.35TB/s", help="device memory bandwidth")
    plan.add_argument("--latency", type=float, default=20e-6, help="seconds per collective")
    plan.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: plan gloo CPU ranks")
    plan.add_argument("--profile", action="store_true",
                      help="time one real decoder layer here (pp_balance='profile's measurement) to set the rates")
    for name, flag in PINS.items():
        plan.add_argument(flag, type=int, dest=f"pin_{name}", help=f"pin {name}_size")
    plan.add_argument("--micro-batch", type=int, help="pin the micro-batch size")
    plan.add_argument("--schedule", choices=PP_SCHEDULES, help="pin the pipeline schedule")
    plan.add_argument("--checkpointing", choices=CHECKPOINTING, help="pin activation checkpointing")
    plan.add_argument("--cp-backend", choices=("ring", "ulysses"), default="ring")
    plan.add_argument("--cross-node-tp", action="store_true", help="allow tp x cp groups across nodes")
    plan.add_argument("--lr", type=float, help="learning rate tuned at --base-batch-size samples")
    plan.add_argument("--lr-scaling", choices=("linear", "sqrt"), help="scale --lr to the global batch")
    plan.add_argument("--base-batch-size", type=int, help="the batch --lr was tuned at")
    plan.add_argument("--json", action="store_true", help="print the result as JSON")
    plan.add_argument("--top", type=int, default=10, help="plans to show (default 10)")
    plan.set_defaults(func=cmd_plan)


def _cluster(args) -> Cluster:
    return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                   gpu_memory=parse_bytes(args.gpu_memory, "--gpu-memory"),
                   intra_bw=parse_bandwidth(args.intra_bw, "--intra-bw"),
                   inter_bw=parse_bandwidth(args.inter_bw, "--inter-bw"),
                   flops=parse_flops(args.gpu_flops, "--gpu-flops"), efficiency=args.efficiency,
                   mem_bw=parse_bandwidth(args.mem_bw, "--mem-bw"), latency=args.latency, device=args.device)


def _lr(args, global_batch: int) -> dict | None:
    given = [a for a in ("lr", "lr_scaling", "base_batch_size") if getattr(args, a) is not None]
    if not given:
        return None
    if len(given) != 3:
        raise PlannerError("learning-rate scaling needs --lr, --lr-scaling and --base-batch-size together")
    return {"learning_rate": scale_lr(args.lr, global_batch, args.base_batch_size, args.lr_scaling),
            "rule": args.lr_scaling, "base_batch_size": args.base_batch_size, "base_lr": args.lr}


def profile_rates(model: str, cluster: Cluster, spec, train: Training) -> tuple[Cluster, str]:
    """Scale the cluster's compute and memory rates so one decoder layer's predicted time matches its
    measured forward+backward time on this machine (a 1-layer copy of the model with random weights)."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from nd_parallel.distributed.pipeline.balance.measure import profile_layers, sample_batch
    from nd_parallel.models.hf import text_config
    from nd_parallel.planner.timing import _rank_mb_seconds

    config = load_config(model)
    text = text_config(config)
    text.num_hidden_layers = 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seq = min(train.seq_len, 512)
    real = AutoModelForCausalLM.from_config(config).to(device)
    costs = profile_layers(real, sample_batch(real, (1, seq)))
    one = dataclasses.replace(spec, num_layers=1, pre_params=0, post_params=0, head_params=0, tied=False)
    probe = Layout(1, 1, 1, 1, 1)
    predicted = _rank_mb_seconds(one, dataclasses.replace(train, seq_len=seq), probe, cluster, 0)
    scale = costs[1].seconds / predicted
    scaled = dataclasses.replace(cluster, flops=cluster.flops / scale, mem_bw=cluster.mem_bw / scale)
    return scaled, (f"profiled one layer on {device} at (1, {seq}): {costs[1].seconds * 1e3:.2f} ms measured vs "
                    f"{predicted * 1e3:.2f} ms predicted; rates scaled by {1 / scale:.3g}")


def cmd_plan(args) -> int:
    try:
        targets = tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None
        spec = spec_from_path(args.model, lora_targets=targets)
        train = Training(seq_len=args.seq_len, global_batch=args.global_batch, dtype=args.dtype,
                         lora_rank=args.lora_rank)
        cluster = _cluster(args)
        note = ""
        if args.profile:
            cluster, note = profile_rates(args.model, cluster, spec, train)
        pins = {name: getattr(args, f"pin_{name}") for name in PINS if getattr(args, f"pin_{name}") is not None}
        cons = Constraints(sizes=pins, micro_batch=args.micro_batch, schedule=args.schedule,
                           checkpointing=args.checkpointing, cp_backend=args.cp_backend,
                           cross_node_tp=args.cross_node_tp)
        result = plan(spec, train, cluster, cons)
        lr = _lr(args, args.global_batch)
    except (PlannerError, UnitError) as err:
        print(f"nd-parallel plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        data = to_json(result, args.top, lr)
        if note:
            data["profile"] = note
        print(json.dumps(data, indent=1))
        return 0 if result.plans else 1
    print(table(result, args.top))
    if note:
        print(note)
    if lr:
        print(f"learning rate: {lr['base_lr']:g} at batch {lr['base_batch_size']} -> {lr['learning_rate']:.4g} at "
              f"batch {args.global_batch} ({lr['rule']} scaling)")
    if result.plans:
        print("\nthe top plan as YAML:\n" + yaml_blocks(result.plans[0], result))
    return 0 if result.plans else 1


def auto_train_layout(cfg, path, nproc: int | None, device: str, environ=None):
    """For `layout: auto` in a train YAML: the ParallelismConfig of the top plan for `nproc` ranks, with the
    YAML's micro_batch_size / gradient_accumulation_steps replaced by the plan's. The global batch kept is what
    the YAML asks for under plain data parallelism: micro_batch_size x gradient_accumulation_steps x nproc."""
    from nd_parallel.config import ConfigError, ParallelismConfig

    if nproc is None:
        raise ConfigError(f"{path}: layout: auto needs the number of ranks; pass --nproc N (or launch with torchrun)")
    global_batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps * nproc
    config = ParallelismConfig.auto(cfg.base_model, seq_len=cfg.sequence_len, global_batch=global_batch,
                                    world_size=nproc, gpus_per_node=nproc, device=device,
                                    dtype="fp32", lora_rank=None)
    lay = config.plan.layout
    if lay.pp > 1:  # the pipeline splits each rank's batch into its micro-batches itself
        cfg.micro_batch_size, cfg.gradient_accumulation_steps = lay.micro_batch * lay.microbatches, 1
    else:
        cfg.micro_batch_size, cfg.gradient_accumulation_steps = lay.micro_batch, lay.microbatches
    return config, global_batch


def scaled_learning_rate(cfg, path, global_batch: int) -> float:
    """`lr_scaling: linear | sqrt` with `base_batch_size`: the YAML's learning_rate scaled to the global batch."""
    from nd_parallel.config import ConfigError

    if cfg.lr_scaling is None:
        return cfg.learning_rate
    if cfg.base_batch_size is None:
        raise ConfigError(f"{path}: lr_scaling: {cfg.lr_scaling} needs base_batch_size (the batch learning_rate "
                          "was tuned at)")
    try:
        return scale_lr(cfg.learning_rate, global_batch, cfg.base_batch_size, cfg.lr_scaling)
    except PlannerError as err:
        raise ConfigError(f"{path}: {err}") from None
