"""Expert parallelism's option: how many ranks split the experts of a mixture-of-experts model."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import ConfigError, _check_count


@dataclass(kw_only=True)
class ExpertParallelOptions:
    """Expert parallelism borrows its ranks from dp_shard (torchtitan borrows from dp_shard x cp; here the cp ranks
    stay outside ep): it adds no rank to the world size. With tp_size > 1 the experts are split over ep only and are
    whole on every tp rank (torchtitan's etp=1); attention and dense MLPs follow the tp_plan."""

    ep_size: int = 1
    """Ranks splitting each MoE layer's experts (each holds num_experts / ep_size). Default 1 = off; >= 1, a divisor
    of dp_shard_size. Expert weights are then FSDP-sharded over the dp_shard_size / ep_size ranks left."""

    def _check_expert_parallel(self) -> None:
        self.ep_size = _check_count("ep_size", self.ep_size, "ep_size=1 to disable expert parallelism")
        if self.ep_size == 1:
            return
        shard = self.dp_shard_size
        # dp_shard_size=-1 is checked again once resolve() fills it in (resolve runs every check).
        if shard != -1 and shard % self.ep_size:
            divisors = [d for d in range(1, shard + 1) if shard % d == 0]
            raise ConfigError(
                f"ep_size={self.ep_size} does not fit dp_shard_size={shard}: expert parallelism borrows its ranks "
                f"from the sharded data-parallel ranks, so ep_size must divide dp_shard_size; use ep_size in "
                f"{divisors}, or a dp_shard_size that is a multiple of {self.ep_size}")
