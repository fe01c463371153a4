"""The planner's inputs and candidates as typed records: the training job, the cluster, one layout."""

from __future__ import annotations

from dataclasses import dataclass

from nd_parallel.config.loss import loss_chunk_for

CHECKPOINTING = ("none", "selective", "full")
DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Training:
    """What is trained: sequence, batch, precision, adapter."""

    seq_len: int
    """Tokens per sample."""
    global_batch: int
    """Samples per optimizer step over all data-parallel ranks."""
    dtype: str = "bf16"
    """"bf16": mixed precision (fp32 master weights and AdamW state, bf16 compute, fp32 gradient reduction);
    "fp32": everything in fp32."""
    lora_rank: int | None = None
    """LoRA rank: the base model is frozen (no grads, no optimizer state); None = full fine-tuning."""
    loss_chunk: int | str = "auto"
    """Tokens per chunk of the chunked loss (ParallelismConfig.loss_chunk_size): "auto" (default) = chosen from the
    tokens one loss call sees (``chunk_tokens``), a positive int = that many tokens, 0 = HF's loss on the full
    logits."""
    sequence_parallel: bool = True
    """Sequence parallelism under TP (ParallelismConfig.sequence_parallel, default "auto": on for dense models, off
    for mixture-of-experts plans): the norms' saved tensors, the layer input and the rowwise outputs are ÷ tp."""

    def chunk_tokens(self, tokens: float) -> int:
        """Tokens per chunk of a loss call over ``tokens`` tokens (this rank's micro-batch after CP's split), as the
        chunked loss resolves it at run time (config/loss.py's ``loss_chunk_for``); 0 = HF's loss. The one place
        the planner resolves ``loss_chunk``."""
        return loss_chunk_for(self.loss_chunk, tokens)

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and of the weights the matmuls read."""
        return 2 if self.dtype == "bf16" else 4


@dataclass(frozen=True)
class Cluster:
    """The machines: how many, how much memory, how fast they compute and talk."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int
    """Bytes usable per device."""
    intra_bw: float = 400e9
    """Bytes/s per device inside a node (NVLink)."""
    inter_bw: float = 50e9
    """Bytes/s per device across nodes (the NIC share of one GPU)."""
    flops: float = 989e12
    """Peak dense FLOP/s per device at the compute dtype."""
    efficiency: float = 0.45
    """Fraction of `flops` matmuls achieve (model FLOPs utilisation of the compute alone)."""
    mem_bw: float = 3.35e12
    """Device memory bandwidth, bytes/s: elementwise ops, the softmax, the optimizer step."""
    latency: float = 20e-6
    """Fixed cost of one collective, seconds."""
    p2p_latency: float | None = None
    """Fixed cost of one send/recv pair (a pipeline hop, a CP ring step), seconds; None = `latency`."""
    op_overhead: float = 5e-6
    """Seconds of host time per aten op (Python, dispatcher, kernel launch): small next to a large model's
    kernels, the step's floor for a small one. The validation benchmark measures it on its ranks."""
    dtensor_op_overhead: float = 50e-6
    """Seconds per op on a DTensor (TP's sharded Linears; the optimizer step over FSDP/TP parameters): sharding
    propagation on top of `op_overhead`."""
    idle_speedup: float = 1.0
    """How much faster a rank computes while the others idle (a pipeline bubble): 1 for a device per rank; about
    ranks/cores when ranks share CPU cores (the validation runs measure it)."""
    device: str = "cuda"
    """"cuda" (foreach AdamW, FSDP prefetches one layer ahead) or "cpu" (gloo ranks: the validation runs)."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    """One candidate: the five sizes and the knobs that only change memory and time."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    pp: int
    micro_batch: int = 1
    """Samples per forward on one data-parallel rank."""
    microbatches: int = 1
    """Forwards per optimizer step on one data-parallel rank: pp micro-batches, or gradient accumulation."""
    schedule: str | None = None
    """Pipeline schedule (pp > 1 only)."""
    virtual: int = 1
    """Pipeline stages per rank."""
    checkpointing: str = "none"
    """Activation checkpointing: "none", "selective" (save matmul/attention outputs) or "full" (layer inputs)."""
    ep: int = 1
    """Expert parallelism: ranks of dp_shard splitting each MoE layer's experts (ParallelismConfig.ep_size)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def shard(self) -> int:
        """Ranks FSDP shards weights, grads and optimizer state over: dp_shard x cp (cp ranks hold equal weights)."""
        return self.dp_shard * self.cp

    @property
    def fsdp(self) -> bool:
        """fully_shard is applied (also for a shard group of one under HSDP, which still gathers a copy)."""
        return self.dp_replicate * self.dp_shard * self.cp > 1

    def sizes(self) -> dict[str, int]:
        """The ParallelismConfig size fields."""
        sizes = {"dp_replicate_size": self.dp_replicate, "dp_shard_size": self.dp_shard, "tp_size": self.tp,
                 "cp_size": self.cp, "pp_size": self.pp}
        return {**sizes, "ep_size": self.ep} if self.ep > 1 else sizes

    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("rep", self.dp_replicate), ("shard", self.dp_shard), ("tp", self.tp),
                                        ("cp", self.cp), ("pp", self.pp), ("ep", self.ep)) if v > 1]
        return "x".join(parts) or "single"
