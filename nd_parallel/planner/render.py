"""The planner's result as a table, as JSON data, and as YAML blocks ready to paste."""

from __future__ import annotations

from .search import Plan, PlanResult
from .units import format_bytes

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "logits", "pipeline_inflight", "comm_buffers",
               "recompute", "layer_backward", "optimizer_step")


def plan_fields(plan: Plan, result: PlanResult) -> dict:
    """One plan as `nd-parallel plan --json` prints it: the sizes (`*_size`), `peak_memory_bytes`, `memory` and
    `step_time_s` are the fields scripts read, so their names stay (the unit tests pin them); knobs and breakdowns
    follow."""
    lay, mem = plan.layout, plan.memory
    tokens = result.train.global_batch * result.train.seq_len
    return {
        **lay.sizes(),
        "micro_batch_size": lay.micro_batch,
        "microbatches": lay.microbatches,
        "pp_schedule": lay.schedule,
        "pp_virtual_stages": lay.virtual,
        "activation_checkpointing": None if lay.checkpointing == "none" else lay.checkpointing,
        "peak_memory_bytes": mem.peak,
        "peak_pp_rank": mem.pp_rank,
        "peak_phase": mem.phase,
        "memory": {k: mem.parts.get(k, 0) for k in MEMORY_KEYS},
        "step_time_s": plan.step_time,
        "time_s": dict(plan.time),
        "tokens_per_s": tokens / plan.step_time,
        "dominant_cost": plan.dominant,
        "effective_batch": {"micro_batch": lay.micro_batch, "accumulation": lay.microbatches,
                            "data_parallel": lay.dp, "samples": lay.micro_batch * lay.microbatches * lay.dp},
    }


def to_json(result: PlanResult, top: int | None = None, lr: dict | None = None) -> dict:
    plans = [plan_fields(p, result) for p in result.plans[:top]]
    if lr:
        for entry in plans:
            entry["learning_rate"] = lr["learning_rate"]
    return {
        "model": result.spec.name,
        # a MoE model: every expert is held (memory), only the top-k run per token (time)
        "params": {"total": result.spec.total_params, "active": result.spec.active_params,
                   "experts": result.spec.num_experts, "experts_per_token": result.spec.experts_per_token},
        "world_size": result.cluster.world,
        "plans": plans,
        "rejected": [{"layout": sizes, "reason": reason} for sizes, reason in result.rejected],
        "hint": result.hint,
        "search": {"settings_evaluated": result.evaluated, "seconds": round(result.seconds, 3)},
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def table(result: PlanResult, top: int = 10) -> str:
    """Ranked plans, memory in GiB per component, then the rejected layouts grouped by reason."""
    head = (f"{'#':>2} {'rep':>3} {'shard':>5} {'tp':>2} {'cp':>2} {'pp':>2} {'ep':>2} {'mb':>3} {'acc':>3} {'schedule':<16} "
            f"{'ckpt':<9} {'peak':>6} {'param':>6} {'grad':>6} {'optim':>6} {'act':>6} {'logit':>6} {'pipe':>6} "
            f"{'comm':>6} {'step s':>8} {'tok/s':>9}  dominant")
    spec = result.spec
    moe = (f", {spec.total_params / 1e9:.1f}B parameters, {spec.active_params / 1e9:.1f}B active per token "
           f"({spec.num_experts} experts, top {spec.experts_per_token})") if spec.num_experts else ""
    lines = [f"nd-parallel plan: {result.spec.name}{moe}, {result.cluster.nodes} x {result.cluster.gpus_per_node} GPUs of "
             f"{format_bytes(result.cluster.gpu_memory)}, seq {result.train.seq_len}, global batch "
             f"{result.train.global_batch}, {result.train.dtype}"
             + (f", LoRA r={result.train.lora_rank}" if result.train.lora_rank else ""),
             "memory columns: GiB per GPU on the busiest rank at its peak; acc = micro-batches per step "
             "(pp micro-batches or gradient accumulation)", head]
    for i, plan in enumerate(result.plans[:top], 1):
        lay, parts = plan.layout, plan.memory.parts
        tokens = result.train.global_batch * result.train.seq_len
        lines.append(
            f"{i:>2} {lay.dp_replicate:>3} {lay.dp_shard:>5} {lay.tp:>2} {lay.cp:>2} {lay.pp:>2} {lay.ep:>2} {lay.micro_batch:>3} "
            f"{lay.microbatches:>3} {(lay.schedule or '-') + (f' v{lay.virtual}' if lay.virtual > 1 else ''):<16} "
            f"{lay.checkpointing:<9} {_gib(plan.memory.peak):>6} "
            + " ".join(f"{_gib(parts.get(k, 0)):>6}" for k in ("params", "grads", "optimizer", "activations",
                                                               "logits", "pipeline_inflight", "comm_buffers"))
            + f" {plan.step_time:>8.3f} {tokens / plan.step_time:>9.0f}  {plan.dominant}")
    if not result.plans:
        lines.append("   (no layout fits)")
    lines.append(f"hint: {result.hint}")
    by_reason: dict[str, list[str]] = {}
    for sizes, reason in result.rejected:
        name = "x".join(f"{k.removesuffix('_size')}{v}" for k, v in sizes.items() if v > 1) or "single"
        by_reason.setdefault(reason if not reason.startswith("needs") else "does not fit: " + reason, []).append(name)
    if by_reason:
        lines.append(f"rejected ({len(result.rejected)} layouts):")
        for reason, names in sorted(by_reason.items(), key=lambda kv: -len(kv[1]))[:12]:
            shown = ", ".join(names[:4]) + (f", ... ({len(names)})" if len(names) > 4 else "")
            lines.append(f"  {shown}: {reason}")
    lines.append(f"searched {result.evaluated} settings in {result.seconds:.2f} s")
    return "\n".join(lines)


def yaml_blocks(plan: Plan, result: PlanResult) -> str:
    """Three blocks: nd-parallel train keys, Axolotl's keys, an accelerate config file."""
    lay, train, cluster = plan.layout, result.train, result.cluster
    ckpt = None if lay.checkpointing == "none" else lay.checkpointing
    ours = [f"dp_replicate_size: {lay.dp_replicate}", f"dp_shard_size: {lay.dp_shard}", f"tp_size: {lay.tp}",
            f"cp_size: {lay.cp}", f"pp_size: {lay.pp}"]
    if lay.pp > 1:
        ours += [f"pp_schedule: {lay.schedule}", f"pp_microbatches: {lay.microbatches}"]
        if lay.virtual > 1:
            ours.append(f"pp_virtual_stages: {lay.virtual}")
    if ckpt:
        ours.append(f"activation_checkpointing: {ckpt}")
    accumulation = 1 if lay.pp > 1 else lay.microbatches
    batch = lay.micro_batch * (lay.microbatches if lay.pp > 1 else 1)
    job = [f"sequence_len: {train.seq_len}", f"micro_batch_size: {batch}",
           f"gradient_accumulation_steps: {accumulation}"]
    axolotl = [f"dp_replicate_size: {lay.dp_replicate}", f"dp_shard_size: {lay.dp_shard}",
               f"tensor_parallel_size: {lay.tp}", f"context_parallel_size: {lay.cp}",
               f"pipeline_parallel_size: {lay.pp}", *job, f"gradient_checkpointing: {str(bool(ckpt)).lower()}",
               f"bf16: {str(train.dtype == 'bf16').lower()}"]
    if train.lora_rank:
        axolotl += ["adapter: lora", f"lora_r: {train.lora_rank}", "lora_target_linear: true"]
    accelerate = ["compute_environment: LOCAL_MACHINE", "distributed_type: FSDP", "fsdp_config:",
                  "  fsdp_version: 2", f"mixed_precision: {'bf16' if train.dtype == 'bf16' else 'no'}",
                  f"num_machines: {cluster.nodes}", f"num_processes: {cluster.world}", "parallelism_config:",
                  f"  parallelism_config_dp_replicate_size: {lay.dp_replicate}",
                  f"  parallelism_config_dp_shard_size: {lay.dp_shard}", f"  parallelism_config_tp_size: {lay.tp}",
                  f"  parallelism_config_cp_size: {lay.cp}"]
    if lay.pp > 1:  # accelerate's file has no pipeline keys; nd_parallel reads them from the environment
        accelerate.append(f"# and export PARALLELISM_CONFIG_PP_SIZE={lay.pp} "
                          f"PARALLELISM_CONFIG_PP_SCHEDULE={lay.schedule} "
                          f"PARALLELISM_CONFIG_PP_MICROBATCHES={lay.microbatches}")
    return "\n".join(["# nd-parallel train (our keys)", *ours, *job, "", "# Axolotl", *axolotl, "",
                      "# accelerate config (accelerate launch --config_file this.yaml train.py)", *accelerate])
