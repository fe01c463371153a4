"""Peak memory per rank: model states by their sharding factors, activations per layer, logits, buffers.

Activations follow the per-layer accounting of Korthikanti et al. (2022), "Reducing Activation Recomputation
in Large Transformer Models" (sbh(34 + 5as/h) bytes for GPT-3 in fp16), redone for the layers we actually run:
- attention through SDPA/flash (or our CP ring kernel) saves q, k, v, the output and a fp32 log-sum-exp per
  head, never the s x s scores (the 5as/h term disappears);
- GQA: k and v are saved un-expanded (kv_heads x head_dim wide);
- gated MLPs save gate, up, act(gate) and act(gate)*up (4f instead of 2f + dropout);
- RMSNorm in transformers upcasts to fp32: per norm it saves the fp32 input, the normalised value (for the
  weight's gradient, absent when the weight is frozen) and the output the next Linear saves;
- no dropout (HF decoders train with p=0); under TP attention and MLP internals are split. Without sequence
  parallelism the norms and the residual stream are replicated over tp; with it (distributed/sequence_parallel.py)
  each norm's fp32 input and normalised value, the layer input kept by checkpointing and the rowwise outputs are
  ÷ tp, while each TP region's gathered input (what its colwise linears save) stays whole.
Checkpointing: "full" keeps one input per layer and recomputes one layer at a time in backward; "selective"
keeps the outputs of every matmul and of attention and recomputes norms, activations and elementwise ops.

The logits: HF's loss upcasts them to fp32 and log_softmax saves its fp32 output; at the start of backward the
logits, that output, its gradient and the logits' gradient are alive together (16 bytes per token per vocab
entry in fp32, 14 in bf16: the held logits are bf16). The chunked loss (distributed/chunked_loss.py, the default)
holds those buffers for one chunk of tokens only, and keeps from its forward to its backward the gradient of the
hidden states (compute dtype) and the fp32 gradient of the head's weight, while the next chunk's head gradient
is added to it (two copies of this rank's head at that moment, the chunk's in the compute dtype; on the probe's
path the larger of two moments of a chunk, ``_probe_loss``). Under TP with a vocabulary-split head the chunked loss
is vocabulary-parallel (distributed/vocab_parallel.py): a chunk's logits buffers are V/tp wide per rank
(``vocab_share``); HF's unchunked loss gathers the logits, so without chunking they stay whole.

Mixture-of-experts layers (checked against a real block's saved tensors in tests/unit/test_planner_moe.py, and
against 4-rank runs under FSDP, TP and EP in benchmarks/bench_planner_moe.py): per token the top-k routed rows in and
out, the experts' 4 x top-k x width, the router's softmax and index vectors. Under expert parallelism the same, for
a balanced router (each rank's experts receive top-k x its own tokens' rows; an unbalanced one puts up to
min(ep, experts / top-k) times that on one rank, which is not added); the all-to-all buffers live only while a MoE
layer runs, so they are counted in the backward-recompute moment, not at the loss.

The peak is the largest of three moments on the busiest pipeline rank: the start of backward (everything saved by
the in-flight forwards, the loss's buffers, the FSDP unsharded copies), inside a layer's backward (what the loss
leaves alive: the held logits or the head's gradient; the layer's recomputed activations and its input gradients;
under FSDP the next layer's prefetched all-gather and the previous layer's reduce-scatter input; the gradients of
the layers already done), and the optimizer step (states plus the step's temporary). With HF's loss the first one
dominates; with the chunked loss (the default) the loss's term is small and the peak moves into the first layer's
backward, or under full checkpointing into a later one's (measured: benchmarks/bench_planner.py). The reported
breakdown is the one at that moment, so it sums to the peak; `RankMemory.moments` has all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nd_parallel.distributed.pipeline.split import uniform_layers

from .layout import Cluster, Layout, Training
from .spec import ModelSpec

FP32 = 4


@dataclass
class RankMemory:
    """Bytes on one rank at its peak, by component (they sum to `peak`)."""

    pp_rank: int
    phase: str
    parts: dict[str, int] = field(default_factory=dict)
    layout: Layout | None = None
    moments: dict[str, dict[str, int]] = field(default_factory=dict)
    """Every moment's breakdown (the peak is the largest): "backward start", "layer backward", "optimizer step"."""

    @property
    def peak(self) -> int:
        return sum(self.parts.values())


def _norm_bytes(train: Training) -> int:
    """Bytes one RMSNorm saves per normalised element (see the module docstring), plus nothing for rsqrt."""
    frozen = train.lora_rank is not None
    if train.dtype == "fp32":
        return 8 if frozen else 12  # x, (x*rsqrt for the weight's grad), weight*x*rsqrt
    return 6 if frozen else 8  # fp32 x, (bf16 x*rsqrt), bf16 output


def _ffn_per_rank(spec: ModelSpec, tp: int, ep: int) -> float:
    """MLP width per token on one rank: split by tp, except the experts under expert parallelism (whole on every
    tp rank, see distributed/tensor_parallel.plan_overrides)."""
    if ep > 1:
        return (spec.ffn - spec.expert_ffn) / tp + spec.expert_ffn
    return spec.ffn / tp


def routed_bytes_per_token(spec: ModelSpec, train: Training) -> float:
    """A MoE layer's routed copies per token, averaged over the layers: each of the top-k rows going into the experts
    (the gathered input the experts' first matmul saves) and coming out (saved by the router-weighted sum)."""
    if not spec.num_experts:
        return 0.0
    share = spec.moe_layers / max(spec.num_layers, 1)
    return 2 * train.compute_bytes * spec.experts_per_token * spec.hidden * share


def router_bytes_per_token(spec: ModelSpec, train: Training) -> float:
    """A MoE layer's routing bookkeeping per token, averaged over the layers (measured on transformers' grouped_mm
    experts, with and without expert parallelism): the router's fp32 softmax (num_experts wide), about four int64
    index vectors of top-k (the choice, the sorted rows' gather, the sort and its inverse) and the sorted routing
    weights. Small next to the routed rows, but the one term that grows with the expert count."""
    if not spec.num_experts:
        return 0.0
    share = spec.moe_layers / max(spec.num_layers, 1)
    k = spec.experts_per_token
    return (FP32 * spec.num_experts + 4 * 8 * k + train.compute_bytes * k) * share


def sequence_split(spec: ModelSpec, train: Training, tp: int) -> int:
    """How many ways the stream between TP regions is split: tp under sequence parallelism (dense models), else 1."""
    return tp if train.sequence_parallel and not spec.num_experts else 1


def norm_activation_bytes(train: Training, hidden: int, sp: int) -> float:
    """One norm per token: its saved tensors on this rank's 1/sp of the tokens, plus the (gathered, whole) output
    the next Linear saves, plus the fp32 rsqrt."""
    b = train.compute_bytes
    return (_norm_bytes(train) - b) * hidden / sp + b * hidden + FP32 / sp


def layer_activation_bytes(spec: ModelSpec, train: Training, tp: int, mode: str, ep: int = 1) -> tuple[float, float]:
    """(bytes saved per token per layer, extra bytes alive per token while one layer is recomputed)."""
    b = train.compute_bytes
    h, q, kv, f = spec.hidden, spec.q_dim / tp, spec.kv_dim / tp, _ffn_per_rank(spec, tp, ep)
    mlp_tensors = 4 if spec.gated_mlp else 2
    norm = _norm_bytes(train)
    sp = sequence_split(spec, train, tp)
    norms = 2 * norm_activation_bytes(train, h, sp)
    if spec.qk_norm:  # its output goes to RoPE, which saves none of it: the norm's input and normalised value only
        norms += (norm - b) * (q + kv) + FP32 * (spec.heads + spec.kv_heads) / tp  # + the per-head fp32 rsqrt
    attention = b * (q + 2 * kv + q) + FP32 * spec.heads / tp  # q, k, v, out (o_proj's input shares it), lse
    moe = routed_bytes_per_token(spec, train) + router_bytes_per_token(spec, train)
    lora = b * train.lora_rank * len(spec.lora_linears) if train.lora_rank else 0.0  # each B saves A's output
    full_layer = norms + attention + b * mlp_tensors * f + moe + lora
    if mode == "none":
        return full_layer, 0.0
    if mode == "full":
        return b * h / sp, full_layer
    # selective: layer input, q/k/v, attention out + lse, o_proj out, the MLP's up-projections, down out
    saved = (b * h / sp + b * (q + 2 * kv) + b * q + FP32 * spec.heads / tp + b * h / sp + b * f * (mlp_tensors // 2)
             + b * h / sp + moe + lora)
    return saved, max(full_layer - saved, 0.0)


def logits_bytes_per_token(spec: ModelSpec, train: Training) -> tuple[int, int]:
    """(bytes per token at the loss's backward, bytes per token held afterwards: the logits themselves)."""
    held = train.compute_bytes * spec.vocab
    return held + 3 * FP32 * spec.vocab, held


def vocab_share(spec: ModelSpec, train: Training, layout: Layout) -> float:
    """The share of the vocabulary whose logits one rank holds in the loss: 1/tp where the chunked loss is
    vocabulary-parallel (a head the plan splits by vocabulary, tp dividing it, a tied embedding split alike, as
    tensor_parallel._vocab_entries requires), else 1 (HF's loss gathers them)."""
    split = (spec.head_tp_sharded and spec.vocab % layout.tp == 0 and (spec.embed_tp_sharded or not spec.tied))
    return 1 / layout.tp if train.loss_chunk and split else 1.0


def head_grad_bytes(spec: ModelSpec, train: Training, layout: Layout) -> float:
    """The head's fp32 weight gradient on this rank (÷ tp where the plan splits it by vocabulary), whole over the dp
    ranks: it is formed at the loss and lives until the optimizer step, or under FSDP until the root group's
    reduce-scatter after the last layer's backward. None under LoRA: peft's all-linear leaves the head frozen."""
    if train.lora_rank is not None:
        return 0.0
    return FP32 * _tp_split(spec.head_params or spec.vocab * spec.hidden, spec.head_tp_sharded, layout.tp, spec.vocab)


def _logits(spec: ModelSpec, train: Training, layout: Layout, tokens: float, flight: float) -> tuple[float, float]:
    """(the loss's bytes at the start of backward, bytes it leaves alive while the layers' backward runs) on the last
    stage."""
    at_loss, held = logits_bytes_per_token(spec, train)
    share = vocab_share(spec, train, layout)
    chunk = train.chunk_tokens(tokens)
    grad_head = head_grad_bytes(spec, train, layout)
    if chunk and (chunk < tokens or share < 1):
        grad_hidden = tokens * train.compute_bytes * spec.hidden
        chunk = min(chunk, tokens)
        if spec.linear_head and share == 1:
            # linear_loss.py's fast path: one fp32 [c, V] buffer (logits, softmax, gradient in place; in bf16 the
            # linear's bf16 output, then the gradient cast back, beside it), the running fp32 head gradient (in
            # bf16 beside it the chunk's bf16 product)
            low = train.compute_bytes if train.compute_bytes < FP32 else 0
            loss = chunk * (FP32 + low) * spec.vocab + grad_hidden + grad_head * (1 + low / FP32)
        else:
            loss = _probe_loss(spec, train, chunk * share, at_loss, grad_head, share < 1) + grad_hidden
        # every other in-flight micro-batch keeps its hidden-state and head gradients until its backward; the
        # hidden states' gradient of the one whose backward runs is consumed by its last layer, its head's is not:
        # the loss's backward hands it to the head's parameter as the model holds it in forward (the compute dtype:
        # under bf16 fully_shard's bf16 copy), and that copy's gradient lives until the root group's reduce-scatter
        others = (flight - 1) * (grad_hidden + grad_head)
        return loss + others, grad_head * train.compute_bytes / FP32 + others
    # The last stage keeps each in-flight micro-batch's logits and log_softmax output until its backward (GPipe:
    # all of them); the one whose backward starts also has both gradients. Through the layers' backward the caller
    # still holds its logits (`out`), and the head's gradient is formed.
    others = (flight - 1) * (held + FP32 * spec.vocab)
    return tokens * (at_loss + others), tokens * (held + others) + grad_head


def _probe_loss(spec: ModelSpec, train: Training, rows: float, at_loss: int, grad_head: float, fused: bool) -> float:
    """The probe's path (chunked_loss._probe_chunks) at the larger of a chunk's two moments; ``rows``: its tokens x
    this rank's share of the vocabulary, ``at_loss``: bytes per token of the unchunked loss's buffers (measured with
    the per-op breakdown, benchmarks/bench_planner_breakdown.py):
    - its log-softmax's backward: the chunk's logits buffers (``at_loss``; under TP's loss_parallel, ``fused``, the
      cross-entropy's backward gives the logits' gradient at once, with no gradient of the log-softmax output
      between) beside the running fp32 head gradient;
    - autograd forming the chunk's head gradient, the log-softmax output and its gradient freed: the chunk's logits
      and their gradient (cast back to the compute dtype) beside the running sum and the chunk's own head gradient
      (compute dtype). The previous chunk's is gone (before issue 21's fix a loop variable held it here)."""
    b = train.compute_bytes
    softmax = rows * (at_loss - (FP32 * spec.vocab if fused else 0)) + grad_head
    head = rows * 2 * b * spec.vocab + grad_head * (1 + b / FP32)
    return max(softmax, head)


def stages_of_rank(layout: Layout, rank: int) -> list[int]:
    """Stage indices pipeline rank `rank` runs (round-robin, or V-shaped for zbv)."""
    if layout.schedule == "zbv":
        return [rank, 2 * layout.pp - 1 - rank]
    return [rank + k * layout.pp for k in range(layout.virtual)]


def inflight(layout: Layout, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of its whole share."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule in ("interleaved-1f1b", "interleaved-zb"):
        # torch's warm-up: (v-1)*p + 2*(p-1-rank) chunk forwards, +1 in steady state; a chunk is 1/v of the share
        return min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1) / v
    return float(min(m, p - rank))  # 1f1b, zbv (ZB-V keeps 1F1B's peak)


def _tp_split(count: int, sharded: bool, tp: int, vocab: int) -> float:
    return count / tp if sharded and vocab % tp == 0 else count


def layer_params_per_rank(spec: ModelSpec, layout: Layout) -> float:
    """One decoder layer's parameters on a rank before FSDP. Under expert parallelism the experts are whole on every
    tp rank and split over ep, then FSDP shards them over the dp ranks left (dp_shard / ep): per rank that is the
    whole experts over dp_shard x cp, as without ep, so they are counted whole here and divided by FSDP's factor."""
    split = spec.layer_tp_params - (spec.layer_expert_tp_params if layout.ep > 1 else 0)
    return split / layout.tp + spec.layer_params - split


def unsharded_layer(spec: ModelSpec, layout: Layout) -> float:
    """One layer's parameters as FSDP gathers them for compute: the experts' ep share only under ep."""
    if layout.ep == 1:
        return layer_params_per_rank(spec, layout)
    return layer_params_per_rank(spec, layout) - spec.layer_expert_params * (1 - 1 / layout.ep)


def rank_params(spec: ModelSpec, layout: Layout, rank: int) -> tuple[float, float, float]:
    """(parameters this pp rank holds before FSDP, of which in decoder layers, of which embedding/head)."""
    num_stages = layout.pp * layout.virtual
    counts = uniform_layers(spec.num_layers, num_stages)
    tp = layout.tp
    per_layer = layer_params_per_rank(spec, layout)
    layers = outer = 0.0
    for stage in stages_of_rank(layout, rank):
        layers += counts[stage] * per_layer
        if stage == 0:
            outer += spec.pre_params - spec.vocab * spec.hidden + _tp_split(spec.vocab * spec.hidden,
                                                                         spec.embed_tp_sharded, tp, spec.vocab)
        if stage == num_stages - 1:
            head = _tp_split(spec.head_params, spec.head_tp_sharded, tp, spec.vocab)
            outer += spec.post_params - (0 if spec.tied else spec.head_params) + head
            if spec.tied and num_stages == 1:
                outer -= head  # one shared weight, already counted with the embedding
    return layers + outer, layers, outer


def rank_memory(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster, rank: int) -> RankMemory:
    """The peak of pipeline rank `rank` and its breakdown (see the module docstring)."""
    b = train.compute_bytes
    p = layout.pp
    num_stages = p * layout.virtual
    counts = uniform_layers(spec.num_layers, num_stages)
    stages = stages_of_rank(layout, rank)
    total, _, outer = rank_params(spec, layout, rank)
    shard = layout.shard if layout.fsdp else 1
    params = FP32 * total / shard
    n_layers = sum(counts[s] for s in stages)
    if train.lora_rank is None:
        trainable = total / shard
    else:
        trainable = n_layers * spec.lora_layer_params(train.lora_rank) / shard
    grads, optimizer = FP32 * trainable, 2 * FP32 * trainable
    tokens = layout.micro_batch * train.seq_len / layout.cp  # per rank per micro-batch
    saved, recompute = layer_activation_bytes(spec, train, layout.tp, layout.checkpointing, layout.ep)
    flight = inflight(layout, rank)
    has_last = num_stages - 1 in stages
    final_norm = norm_activation_bytes(train, spec.hidden, sequence_split(spec, train, layout.tp)) if has_last else 0
    activations = flight * tokens * (n_layers * saved + final_norm)
    pipeline = flight * tokens * 2 * b * spec.hidden * len(stages) if p > 1 else 0  # stage output + recv buffer
    logits, held_logits = _logits(spec, train, layout, tokens, flight) if has_last else (0, 0)
    comm = 0.0
    # Unsharded compute copies: the current layer (+1 prefetched on CUDA) and the root group. Under bf16 every
    # layout has them: fully_shard runs even over one rank, to cast the fp32 weights (precision.py).
    fully_shard = layout.fsdp or train.dtype == "bf16"
    if fully_shard:
        comm += b * unsharded_layer(spec, layout) * (2 if cluster.device == "cuda" else 1) + b * outer
    # One MoE layer's all-to-all send and receive buffers (top-k rows per token, balanced) live only while that
    # layer runs: not at the loss, where backward starts (measured, bench_planner_moe.py), but in its backward.
    a2a = 2 * b * tokens * spec.experts_per_token * spec.hidden if layout.ep > 1 else 0.0
    if layout.cp > 1:  # K/V blocks in flight around the ring: receive buffer + the next one, k and v
        comm += 4 * b * tokens * spec.kv_dim / layout.tp
    grads_at_peak = grads if (layout.microbatches > flight or (p == 1 and layout.microbatches > 1)) else 0
    if p > 1 and fully_shard:  # torch's schedules skip FSDP's gradient sync before the last micro-batch: whole
        grads_at_peak *= shard
    states = {"params": params, "grads": grads_at_peak, "optimizer": optimizer}
    # Under PP the loss runs after the stage's forward returned, when FSDP's root post-forward has freed the last
    # layer's all-gather output (measured: no layer-sized buffer at a pipeline stage's loss, one without PP)
    start_comm = comm - (b * unsharded_layer(spec, layout) if fully_shard and p > 1 else 0.0)
    start = {**states, "activations": activations, "logits": logits, "pipeline_inflight": pipeline,
             "comm_buffers": start_comm, "recompute": 0.0, "layer_backward": 0.0}
    if fully_shard and cluster.device == "cuda":  # the prefetch: counted by _layer_backward
        comm -= b * unsharded_layer(spec, layout)
    mid = {**start, "logits": held_logits, "recompute": tokens * recompute, "comm_buffers": comm + a2a,
           "activations": activations - tokens * final_norm}
    mid = _layer_backward(spec, train, layout, mid, n_layers=n_layers, tokens=tokens, saved=saved, shard=shard,
                          fully_shard=fully_shard,
                          trainable_layer=(layer_params_per_rank(spec, layout) if train.lora_rank is None
                                           else spec.lora_layer_params(train.lora_rank)) / shard)
    largest = spec.largest_param / (layout.tp * shard) if cluster.device == "cpu" else trainable
    step = {**states, "grads": grads, "optimizer_step": FP32 * largest}
    phases = {"backward start": start, "layer backward": mid, "optimizer step": step}
    moments = {name: {k: int(v) for k, v in parts.items()} for name, parts in phases.items()}
    phase = max(moments, key=lambda k: sum(moments[k].values()))
    return RankMemory(rank, phase, moments[phase], moments=moments)


def _layer_backward(spec: ModelSpec, train: Training, layout: Layout, at: dict, *, n_layers: int, tokens: float,
                    saved: float, shard: int, fully_shard: bool, trainable_layer: float) -> dict:
    """The largest moment inside one layer's backward, over this rank's layers (measured with the allocator-level
    tracker, benchmarks/bench_planner.py): `at` holds what every layer's backward has (the states, every saved
    activation, the loss's leftovers, the current layer's recompute and unsharded copy); each layer adds
    - its MLP's input gradients: the down projection's input gradient, then act(gate)'s and up's (gated), while
      the down projection's saved input is already freed: 2 token x ffn wide net (1 ungated), plus the residual
      stream's gradient and the down projection's fp32 weight gradient;
    and, with j layers of this micro-batch already done (their saved activations freed):
    - their gradients (FSDP: the reduce-scattered shards; else whole), unless the states already hold them;
    - under FSDP the next layer's all-gather output (FSDP2 prefetches one layer in backward, on CPU too) while one
      is left, and the previous layer's fp32 reduce-scatter input (kept until the next reduce-scatter) once j > 0.
    Without checkpointing j = 0 is the largest (each layer frees more activations than gradients it adds); with full
    checkpointing the one before last, where both FSDP buffers and most of the gradients are alive."""
    b = train.compute_bytes
    f = _ffn_per_rank(spec, layout.tp, layout.ep)
    work = tokens * b * ((2 if spec.gated_mlp else 1) * f + spec.hidden) + FP32 * spec.hidden * f
    unsharded = b * unsharded_layer(spec, layout)
    # the reduce-scatter input: the gradients of what the all-gather gave (under ep: the experts' ep share), fp32
    reduce_input = FP32 * (unsharded_layer(spec, layout) if train.lora_rank is None else trainable_layer * shard)
    best: dict = {}
    for j in range(max(n_layers, 1)):
        grads = 0.0 if at["grads"] else j * FP32 * trainable_layer
        comm = (unsharded * (j < n_layers - 1) + reduce_input * (j > 0)) if fully_shard else 0.0
        moment = {**at, "activations": at["activations"] - j * tokens * saved, "grads": at["grads"] + grads,
                  "comm_buffers": at["comm_buffers"] + comm, "layer_backward": work}
        if sum(moment.values()) > sum(best.values()):
            best = moment
    return best


def peak_memory(spec: ModelSpec, train: Training, layout: Layout, cluster: Cluster) -> RankMemory:
    """The busiest pipeline rank's peak (every rank when pp == 1 is alike)."""
    ranks = [rank_memory(spec, train, layout, cluster, r) for r in range(layout.pp)]
    busiest = max(ranks, key=lambda m: m.peak)
    busiest.layout = layout
    return busiest
