"""Expert parallelism: each rank of the ep mesh holds num_experts / ep of every MoE layer's experts.

``check_model`` refuses what cannot work before any collective; ``apply_ep`` splits the experts in place (their
stacked weights become DTensors ``Shard(0)`` on the ep mesh) and routes every call through ``dispatch.py``.
"""

from .apply import apply_ep, check_model

__all__ = ["apply_ep", "check_model"]
