"""The context-parallel attention kernels, in one import (hf.py registers them with transformers).

    ring_attention      ring.py     K/V travel around the cp ring; any head count
    ulysses_attention   ulysses.py  all-to-all to head shards; heads and kv heads divisible by cp
    local_attention     ring.py     the same exact masked attention on one process
    KVMeta, reference_mask          blocks.py: per-shard token metadata and the mask it defines
    comm_stats                      ring.py: bytes sent and time spent, for benchmarks
"""

from .blocks import KVMeta, concat_metas, plan_blocks, reference_mask
from .ring import CommStats, comm_stats, local_attention, ring_attention
from .ulysses import check_ulysses_heads, ulysses_attention

__all__ = ["KVMeta", "CommStats", "check_ulysses_heads", "comm_stats", "concat_metas", "local_attention",
           "plan_blocks", "reference_mask", "ring_attention", "ulysses_attention"]
