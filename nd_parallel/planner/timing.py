"""Step time: FLOPs and memory traffic per pipeline rank, the schedule's bubble, and communication per dimension.

compute    2 FLOPs per weight per token forward, twice that backward (once for a frozen LoRA base: no weight
           gradient), causal attention 2*s*q_dim per token forward; full checkpointing adds one forward. Matmuls
           run at cluster.flops * cluster.efficiency.
elementwise  norms, activations, the softmax and the loss move their saved bytes about three times (write in
           forward, read and write in backward) at cluster.mem_bw; recomputation moves them again.
bubble     gpipe / 1f1b: one micro-batch of every rank but the slowest (fill and drain; p-1 slots when the stages
           are balanced); interleaved-1f1b: divided by v; zero-bubble
           schedules fill most of it with weight-gradient work: a third of that (ZB-H1), a sixth for ZB-V.
           Ranks that share cores (cluster.idle_speedup > 1) run the critical path (m micro-batches of the
           slowest rank + fill) up to idle_speedup times faster while the others wait, but the step is never
           shorter than every rank's work at the all-busy rate (the cores' throughput); with a device per rank
           (idle_speedup 1) that bound never binds. The split between compute and bubble keeps their ratio.
fsdp       per micro-batch, all-gather of the rank's layers forward and again backward (compute dtype) and a
           reduce-scatter of the trainable gradients (fp32): ~3x the parameters, times (n-1)/n.
dp         HSDP: all-reduce of the sharded gradients across replicas, per micro-batch.
tp         two all-reduces of the hidden state per layer forward and two backward (no sequence parallelism),
           plus the logits all-gather of the vocabulary-sharded head.
cp         the ring passes K/V blocks cp-1 times per layer forward, and K/V plus dK/dV backward.
pp         one activation forward and one gradient backward per micro-batch per stage boundary.
dispatch   every aten op pays cluster.op_overhead of host time, every op on a DTensor cluster.dtensor_op_overhead;
           the ops are counted on the model (ops.py): per layer forward + backward (with the LoRA wrappers when
           an adapter is trained; full checkpointing runs the forward again), of which the TP-planned modules'
           run on DTensors under TP; the CP ring's steps (the diagonal one, cp-1 off-diagonal ones); embedding,
           head and loss on the last pipeline rank; AdamW per trainable tensor (for-loop on CPU: its ops run on
           DTensors when FSDP, DDP-by-replicate or TP made the parameters DTensors) or once (foreach on CUDA).
           On CUDA the host runs ahead of the device, so only host time beyond a rank's compute is added.
Each collective also pays cluster.latency, each send/recv pair cluster.p2p_latency: TP all-reduces once per
rowwise module forward and once per colwise module backward (each input gradient separately). A dimension talks at
cluster.intra_bw when its group fits inside a node (mesh order pp, dp_replicate, dp_shard, cp, tp: tp is
innermost) and at cluster.inter_bw otherwise. Communication and dispatch are added, not overlapped: an upper
bound that ranks layouts the way they are measured on gloo.
"""

from __future__ import annotations

import math

from nd_parallel.distributed.pipeline.split import uniform_layers

from .layout import Cluster, Layout, Training
from .memory import FP32, layer_activation_bytes, logits_bytes_per_token, rank_params, stages_of_rank, vocab_share
from .spec import ModelSpec

BUBBLE_SLOTS = {"gpipe": 1.0, "1f1b": 1.0, "interleaved-1f1b": 1.0, "interleaved-zb": 1 / 3, "zbv": 1 / 6}


def _bandwidth(layout: Layout, cluster: Cluster, dim: str) -> float:
    """intra_bw when the group of `dim` spans at most one node, else inter_bw."""
    if dim == "ep":  # ep is dp_shard's innermost part: ep x cp x tp neighbouring ranks
        span = layout.ep * layout.cp * layout.tp
        return cluster.intra_bw if span <= cluster.gpus_per_node else cluster.inter_bw
    inner = {"tp": 1, "cp": layout.tp, "dp_shard": layout.tp, "dp_replicate": layout.tp * layout.cp * layout.dp_shard,
             "pp": layout.tp * layout.cp * layout.dp}[dim]
    size = {"tp": layout.tp, "cp": layout.cp, "dp_shard": layout.dp_shard * layout.cp,
            "dp_replicate": layout.dp_replicate, "pp": layout.pp}[dim]
    span = size * inner if dim != "dp_shard" else layout.dp_shard * layout.cp * layout.tp
    return cluster.intra_bw if span <= cluster.gpus_per_node else cluster.inter_bw


def _rank_mb_seconds(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster, rank: int) -> float:
    """Compute + elementwise time of one micro-batch forward and backward on pipeline rank `rank`."""
    counts = uniform_layers(spec.num_layers, layout.pp * layout.virtual)
    stages = stages_of_rank(layout, rank)
    n_layers = sum(counts[s] for s in stages)
    tokens = layout.micro_batch * train.seq_len / layout.cp
    tp, frozen = layout.tp, train.lora_rank is not None
    backward = 1.0 if frozen else 2.0
    recompute = 1.0 if layout.checkpointing == "full" else 0.0
    matmul_params = spec.layer_matmul_params / tp
    if layout.ep > 1 and spec.num_experts:  # the experts are whole on every tp rank under ep: their FLOPs too
        active = spec.layer_expert_params * spec.experts_per_token / spec.num_experts
        matmul_params += active - active / tp
    matmul = 2 * matmul_params * (1 + backward + recompute)
    attention = 2 * train.seq_len * spec.q_dim / tp * (1 + 2 + recompute)
    lora = 6 * spec.lora_layer_params(train.lora_rank) if frozen else 0
    flops = tokens * n_layers * (matmul + attention + lora)
    saved = layer_activation_bytes(spec, train, tp, "none", layout.ep)[0]
    redo = layer_activation_bytes(spec, train, tp, layout.checkpointing, layout.ep)[1]  # recomputed bytes, 0 without
    traffic = tokens * n_layers * (3 * saved + 2 * redo)
    if layout.pp * layout.virtual - 1 in stages:
        vocab = spec.vocab / tp if spec.head_tp_sharded and spec.vocab % tp == 0 else spec.vocab
        flops += tokens * 2 * spec.hidden * vocab * (1 + backward)
        traffic += tokens * 2 * logits_bytes_per_token(spec, train)[0] * vocab_share(spec, train, layout)
    return flops / (cluster.flops * cluster.efficiency) + traffic / cluster.mem_bw


def _dispatch_mb(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster, rank: int) -> float:
    """Host seconds of the aten ops of one micro-batch forward and backward on pipeline rank `rank`."""
    ops = spec.ops
    counts = uniform_layers(spec.num_layers, layout.pp * layout.virtual)
    stages = stages_of_rank(layout, rank)
    n_layers = sum(counts[s] for s in stages)
    if train.lora_rank is not None:
        per_layer = ops.lora_layer_fwd + ops.lora_layer_bwd
    else:
        per_layer = ops.layer_fwd + ops.layer_bwd
    if layout.checkpointing == "full":  # the layer's forward runs again before its backward
        per_layer += ops.lora_layer_fwd if train.lora_rank is not None else ops.layer_fwd
    dtensor = ops.tp_layer if layout.tp > 1 else 0
    if layout.cp > 1:
        per_layer += ops.ring_diagonal + (layout.cp - 1) * ops.ring_off_diagonal
    plain, dt = n_layers * (per_layer - dtensor), n_layers * dtensor
    if layout.pp * layout.virtual - 1 in stages:
        rest_dt = ops.tp_rest if layout.tp > 1 else 0
        plain += ops.rest_fwd + ops.rest_bwd - rest_dt
        dt += rest_dt
    return plain * cluster.op_overhead + dt * cluster.dtensor_op_overhead


def _optimizer_dispatch(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster) -> float:
    """Host seconds of the AdamW step's ops on the rank with the most trainable tensors."""
    ops = spec.ops
    if cluster.device != "cpu":  # foreach: a fixed number of ops over the whole list
        return ops.adam_foreach * cluster.op_overhead
    counts = uniform_layers(spec.num_layers, layout.pp * layout.virtual)
    tensors = 0
    for r in range(layout.pp):
        stages = stages_of_rank(layout, r)
        n_layers = sum(counts[s] for s in stages)
        if train.lora_rank is not None:
            tensors = max(tensors, n_layers * 2 * len(spec.lora_linears))  # A and B per target
        else:  # the embedding, final norm and head: counted on every rank (an upper bound for pp > 1)
            tensors = max(tensors, n_layers * spec.layer_tensors + spec.rest_tensors)
    distributed = layout.fsdp or layout.dp_replicate > 1 or layout.tp > 1  # parameters are DTensors
    per_op = cluster.dtensor_op_overhead if distributed else cluster.op_overhead
    return tensors * (ops.adam_tensor * per_op + ops.adam_scalar * cluster.op_overhead)


def _allreduce(nbytes: float, n: int, bw: float, latency: float) -> float:
    return 2 * (n - 1) / n * nbytes / bw + latency if n > 1 else 0.0


def _gather(nbytes: float, n: int, bw: float, latency: float) -> float:
    """All-gather or reduce-scatter of `nbytes` (the unsharded size)."""
    return (n - 1) / n * nbytes / bw + latency if n > 1 else 0.0


def _compute(per_rank: list[float], layout: Layout, cluster: Cluster) -> dict[str, float]:
    """The "compute" and "bubble" components from each pipeline rank's micro-batch seconds."""
    p, m = layout.pp, layout.microbatches
    slowest = max(per_rank)
    out = {"compute": m * slowest, "bubble": 0.0}
    if p > 1:
        # fill and drain pass through every other rank once: their micro-batch times, not p-1 of the slowest
        # (equal for balanced stages; the last stage's head and loss make it slower than the rest)
        fill = (sum(per_rank) - slowest) / layout.virtual * BUBBLE_SLOTS[layout.schedule]
        # ranks sharing cores (idle_speedup > 1): a waiting rank leaves its share to the busy ones, so the
        # critical path runs up to idle_speedup times faster, but never faster than the cores get through every
        # rank's work (the mean at the all-busy rate); with a device per rank this is m * slowest + fill
        critical = (m * slowest + fill) / cluster.idle_speedup
        out["compute"] = max(critical, m * sum(per_rank) / p) * m * slowest / (m * slowest + fill)
        out["bubble"] = max(critical, m * sum(per_rank) / p) - out["compute"]
    return out


def _data_parallel(train: Training, layout: Layout, cluster: Cluster, n_layers: int, total: float,
                   trainable: float, gathered: float | None = None) -> dict[str, float]:
    """FSDP's gathers and gradient reduction, and HSDP's all-reduce across replicas (empty without FSDP)."""
    if not layout.fsdp:
        return {}
    m, lat, b = layout.microbatches, cluster.latency, train.compute_bytes
    n, bw = layout.shard, _bandwidth(layout, cluster, "dp_shard")
    per_group = (n_layers + 1)  # one group per layer + the root
    # gloo has no reduce-scatter: torch runs an all-reduce of the whole gradient instead
    scatter = (_allreduce if cluster.device == "cpu" else _gather)(FP32 * trainable, n, bw, 0)
    gathers = 2 * _gather(b * (total if gathered is None else gathered), n, bw, 0) + scatter
    return {"fsdp": m * (gathers + 3 * per_group * lat * (n > 1)),
            "dp": m * (_allreduce(FP32 * trainable / n, layout.dp_replicate,
                                  _bandwidth(layout, cluster, "dp_replicate"), 0)
                       + per_group * lat * (layout.dp_replicate > 1))}


def _model_parallel(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster,
                    n_layers: int) -> dict[str, float]:
    """TP's all-reduces and logits gather, the CP ring's K/V hops, the pipeline's activation hops."""
    p, m, lat, b = layout.pp, layout.microbatches, cluster.latency, train.compute_bytes
    p2p = cluster.latency if cluster.p2p_latency is None else cluster.p2p_latency
    tokens = layout.micro_batch * train.seq_len / layout.cp
    out = {}
    if layout.tp > 1:
        bw = _bandwidth(layout, cluster, "tp")
        hidden = b * tokens * spec.hidden
        # rowwise modules all-reduce their output forward, colwise ones their input gradient backward (q, k and v
        # each their own); a plan without the counts (a hand-made spec) keeps the classic two + two per layer
        per_layer = (spec.layer_colwise + spec.layer_rowwise) or 4
        per_mb = (n_layers * per_layer + spec.embed_tp_sharded) * _allreduce(hidden, layout.tp, bw, lat)
        if vocab_share(spec, train, layout) < 1:
            # vocabulary-parallel chunked loss: per chunk, torch's loss_parallel all-reduces the tokens' max, sum-exp
            # and target logits, and the chunk's hidden-state gradient is all-reduced
            n = math.ceil(tokens / min(train.chunk_tokens(tokens), tokens))
            per_mb += n * (3 * _allreduce(FP32 * tokens / n, layout.tp, bw, lat) + _allreduce(hidden / n, layout.tp,
                                                                                               bw, lat))
        elif spec.head_tp_sharded:  # logits gathered forward, the head's input gradient all-reduced backward
            per_mb += _gather(b * tokens * spec.vocab, layout.tp, bw, lat) + _allreduce(hidden, layout.tp, bw, lat)
        out["tp"] = m * per_mb
    if layout.cp > 1:
        bw = _bandwidth(layout, cluster, "cp")
        block = b * tokens * 2 * spec.kv_dim / layout.tp  # this rank's k and v
        # forward: cp-1 K/V hops; backward: cp-1 K/V hops and cp dK/dV hops (the last one home)
        out["cp"] = m * n_layers * (3 * (layout.cp - 1) * block / bw + (3 * layout.cp - 2) * p2p)
    if layout.ep > 1 and spec.num_experts:
        out["ep"] = m * all_to_all_seconds(spec, train, layout, cluster, n_layers)
    if p > 1:
        bw = _bandwidth(layout, cluster, "pp")
        hop = b * tokens * spec.hidden / layout.tp / bw + p2p
        out["pp"] = 2 * (m + p - 1) * hop * layout.virtual
    return out


def all_to_all_bytes(spec: ModelSpec, train: Training, layout: Layout, n_layers: int) -> float:
    """Bytes one rank sends per micro-batch in expert parallelism's all-to-alls: per MoE layer, each token's top-k
    rows go to their experts' ranks and come back (2 directions) in forward, and again in backward (and in the
    recomputed forward under full checkpointing); the (ep-1)/ep share owned by other ranks leaves the rank."""
    tokens = layout.micro_batch * train.seq_len / layout.cp
    moe_layers = n_layers * spec.moe_layers / max(spec.num_layers, 1)
    passes = 2 * (2 + (layout.checkpointing == "full"))
    return passes * moe_layers * tokens * spec.experts_per_token * spec.hidden * train.compute_bytes * (
        layout.ep - 1) / layout.ep


def all_to_all_seconds(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster, n_layers: int) -> float:
    """The all-to-alls of one micro-batch: their bytes over the ep group's bandwidth, plus a latency per exchange
    (rows, expert ids and the counts in forward, rows back; the reverse in backward)."""
    moe_layers = n_layers * spec.moe_layers / max(spec.num_layers, 1)
    exchanges = moe_layers * (4 + 2 + 2 * (layout.checkpointing == "full"))
    return all_to_all_bytes(spec, train, layout, n_layers) / _bandwidth(layout, cluster, "ep") + exchanges * cluster.latency


def _add_dispatch(out: dict[str, float], spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster,
                  per_rank: list[float]) -> None:
    """Set "dispatch" (host time per step) and add its pipeline fill and drain to "bubble"."""
    p, m = layout.pp, layout.microbatches
    host = [_dispatch_mb(spec, train, layout, cluster, r) for r in range(p)]
    if cluster.device != "cpu":  # the host queues kernels ahead of the device: only host time beyond it shows
        host = [max(0.0, h - c) for h, c in zip(host, per_rank)]
    out["dispatch"] = m * max(host)
    if p > 1:  # host time fills and drains the pipeline too
        host_fill = (sum(host) - max(host)) / layout.virtual * BUBBLE_SLOTS[layout.schedule]
        critical = (out["dispatch"] + host_fill) / cluster.idle_speedup
        total = max(critical, m * sum(host) / p)
        out["bubble"] += total - out["dispatch"]


def step_time(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster) -> dict[str, float]:
    """Seconds per optimizer step, by component (they sum to the step time, in this key order: compute, bubble,
    fsdp, dp, tp, cp, ep, pp, optimizer, dispatch; the ones a layout does not use are absent)."""
    p = layout.pp
    per_rank = [_rank_mb_seconds(spec, train, layout, cluster, r) for r in range(p)]
    out = _compute(per_rank, layout, cluster)
    counts = uniform_layers(spec.num_layers, p * layout.virtual)
    n_layers = max(sum(counts[s] for s in stages_of_rank(layout, r)) for r in range(p))
    total = max(rank_params(spec, layout, r)[0] for r in range(p))
    trainable = total if train.lora_rank is None else n_layers * spec.lora_layer_params(train.lora_rank)
    gathered = None
    if layout.ep > 1 and spec.num_experts:  # FSDP gathers only this rank's ep share of each layer's experts
        gathered = total - n_layers * spec.moe_layers / spec.num_layers * spec.layer_expert_params * (1 - 1 / layout.ep)
    out.update(_data_parallel(train, layout, cluster, n_layers, total, trainable, gathered))
    out.update(_model_parallel(spec, train, layout, cluster, n_layers))
    out["optimizer"] = (28 * trainable / (layout.shard if layout.fsdp else 1) / cluster.mem_bw
                        + _optimizer_dispatch(spec, train, layout, cluster))
    _add_dispatch(out, spec, train, layout, cluster, per_rank)
    return out
