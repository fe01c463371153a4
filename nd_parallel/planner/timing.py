"""Step time: FLOPs and memory traffic per pipeline rank, the schedule's bubble, and communication per dimension.

compute    2 FLOPs per weight per token forward, twice that backward (once for a frozen LoRA base: no weight
           gradient), causal attention 2*s*q_dim per token forward; full checkpointing adds one forward. Matmuls
           run at cluster.flops * cluster.efficiency.
elementwise  norms, activations, the softmax and the loss move their saved bytes about three times (write in
           forward, read and write in backward) at cluster.mem_bw; recomputation moves them again.
bubble     gpipe / 1f1b: p-1 micro-batch slots of the slowest rank; interleaved-1f1b: (p-1)/v; zero-bubble
           schedules fill most of it with weight-gradient work: a third of that (ZB-H1), a sixth for ZB-V.
fsdp       per micro-batch, all-gather of the rank's layers forward and again backward (compute dtype) and a
           reduce-scatter of the trainable gradients (fp32): ~3x the parameters, times (n-1)/n.
dp         HSDP: all-reduce of the sharded gradients across replicas, per micro-batch.
tp         two all-reduces of the hidden state per layer forward and two backward (no sequence parallelism),
           plus the logits all-gather of the vocabulary-sharded head.
cp         the ring passes K/V blocks cp-1 times per layer forward, and K/V plus dK/dV backward.
pp         one activation forward and one gradient backward per micro-batch per stage boundary.
Each collective also pays cluster.latency. A dimension talks at cluster.intra_bw when its group fits inside a
node (mesh order pp, dp_replicate, dp_shard, cp, tp: tp is innermost) and at cluster.inter_bw otherwise.
Communication is added, not overlapped: an upper bound that ranks layouts the way they are measured on gloo.
"""

from __future__ import annotations

from ..pipeline.split import uniform_layers
from .layout import Cluster, Layout, Training
from .memory import FP32, layer_activation_bytes, logits_bytes_per_token, rank_params, stages_of_rank
from .spec import ModelSpec

BUBBLE_SLOTS = {"gpipe": 1.0, "1f1b": 1.0, "interleaved-1f1b": 1.0, "interleaved-zb": 1 / 3, "zbv": 1 / 6}


def _bandwidth(layout: Layout, cluster: Cluster, dim: str) -> float:
    """intra_bw when the group of `dim` spans at most one node, else inter_bw."""
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
    matmul = 2 * spec.layer_matmul_params / tp * (1 + backward + recompute)
    attention = 2 * train.seq_len * spec.q_dim / tp * (1 + 2 + recompute)
    lora = 6 * spec.lora_layer_params(train.lora_rank) if frozen else 0
    flops = tokens * n_layers * (matmul + attention + lora)
    saved = layer_activation_bytes(spec, train, tp, "none")[0]
    redo = layer_activation_bytes(spec, train, tp, layout.checkpointing)[1]  # recomputed bytes, 0 without
    traffic = tokens * n_layers * (3 * saved + 2 * redo)
    if layout.pp * layout.virtual - 1 in stages:
        vocab = spec.vocab / tp if spec.head_tp_sharded and spec.vocab % tp == 0 else spec.vocab
        flops += tokens * 2 * spec.hidden * vocab * (1 + backward)
        traffic += tokens * 2 * logits_bytes_per_token(spec, train)[0]
    return flops / (cluster.flops * cluster.efficiency) + traffic / cluster.mem_bw


def _allreduce(nbytes: float, n: int, bw: float, latency: float) -> float:
    return 2 * (n - 1) / n * nbytes / bw + latency if n > 1 else 0.0


def _gather(nbytes: float, n: int, bw: float, latency: float) -> float:
    """All-gather or reduce-scatter of `nbytes` (the unsharded size)."""
    return (n - 1) / n * nbytes / bw + latency if n > 1 else 0.0


def step_time(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster) -> dict[str, float]:
    """Seconds per optimizer step, by component (they sum to the step time)."""
    p, m, lat = layout.pp, layout.microbatches, cluster.latency
    b = train.compute_bytes
    per_rank = [_rank_mb_seconds(spec, train, layout, cluster, r) for r in range(p)]
    slowest = max(per_rank)
    out = {"compute": m * slowest, "bubble": 0.0}
    if p > 1:
        out["bubble"] = (p - 1) / layout.virtual * BUBBLE_SLOTS[layout.schedule] * slowest
    tokens = layout.micro_batch * train.seq_len / layout.cp
    counts = uniform_layers(spec.num_layers, p * layout.virtual)
    n_layers = max(sum(counts[s] for s in stages_of_rank(layout, r)) for r in range(p))
    total = max(rank_params(spec, layout, r)[0] for r in range(p))
    trainable = total if train.lora_rank is None else n_layers * spec.lora_layer_params(train.lora_rank)
    if layout.fsdp:
        n, bw = layout.shard, _bandwidth(layout, cluster, "dp_shard")
        per_group = (n_layers + 1)  # one group per layer + the root
        # gloo has no reduce-scatter: torch runs an all-reduce of the whole gradient instead
        scatter = (_allreduce if cluster.device == "cpu" else _gather)(FP32 * trainable, n, bw, 0)
        gathers = 2 * _gather(b * total, n, bw, 0) + scatter
        out["fsdp"] = m * (gathers + 3 * per_group * lat * (n > 1))
        out["dp"] = m * (_allreduce(FP32 * trainable / n, layout.dp_replicate,
                                    _bandwidth(layout, cluster, "dp_replicate"), 0)
                         + per_group * lat * (layout.dp_replicate > 1))
    if layout.tp > 1:
        bw = _bandwidth(layout, cluster, "tp")
        hidden = b * tokens * spec.hidden
        per_mb = n_layers * 4 * _allreduce(hidden, layout.tp, bw, lat) + _allreduce(hidden, layout.tp, bw, lat)
        if spec.head_tp_sharded:  # logits gathered forward, split (free) backward
            per_mb += _gather(b * tokens * spec.vocab, layout.tp, bw, lat)
        out["tp"] = m * per_mb
    if layout.cp > 1:
        bw = _bandwidth(layout, cluster, "cp")
        block = b * tokens * 2 * spec.kv_dim / layout.tp  # this rank's k and v
        out["cp"] = m * n_layers * 3 * (layout.cp - 1) * (block / bw + lat)
    if p > 1:
        bw = _bandwidth(layout, cluster, "pp")
        hop = b * tokens * spec.hidden / layout.tp / bw + lat
        out["pp"] = 2 * (m + p - 1) * hop * layout.virtual
    out["optimizer"] = 28 * trainable / (layout.shard if layout.fsdp else 1) / cluster.mem_bw
    return out
