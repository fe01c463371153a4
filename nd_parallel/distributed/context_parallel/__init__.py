"""Context parallelism: the sequence of every sample is split over the cp ranks.

sharding.py cuts a batch into each rank's (load-balanced) share of the sequence; ring.py, ulysses.py and blocks.py
hold the attention kernels (attention.py gathers their public names); hf.py registers them in transformers'
AttentionInterface and wires the sharding into a prepared model.
"""

from .hf import (
    CPRuntime,
    SequenceSharding,
    active,
    check_model,
    gather_sequence,
    pad_token_id,
    runtime_for,
    shard_inputs,
    use_cp_attention,
)

__all__ = ["CPRuntime", "SequenceSharding", "active", "check_model", "gather_sequence", "pad_token_id", "runtime_for",
           "shard_inputs", "use_cp_attention"]
