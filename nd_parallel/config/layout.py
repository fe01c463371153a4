"""The layout: how many ranks each of the five parallel dimensions spans, and the world size they multiply to."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .checks import ConfigError, _check_count, _is_int

if TYPE_CHECKING:  # Python 3.10 has no typing.Self; annotations are never evaluated at run time
    from typing_extensions import Self

# Mesh order, outermost first; error messages print the equation in this order too.
SIZE_FIELDS = ("pp_size", "dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
# What the neutral value of each size means; quoted as the fix in error messages.
_NEUTRAL = {
    "pp_size": "pp_size=1 to disable pipeline parallelism",
    "dp_replicate_size": "dp_replicate_size=1 to disable replicated data parallelism",
    "dp_shard_size": "dp_shard_size=1 to disable sharding, or -1 to shard over the ranks left over",
    "cp_size": "cp_size=1 to disable context parallelism",
    "tp_size": "tp_size=1 to disable tensor parallelism",
}


@dataclass(kw_only=True)
class Layout:
    """Sizes of the five parallel dimensions."""

    dp_replicate_size: int = 1
    """Data-parallel replicas, each with a full copy of the weights (HSDP). Default 1; >= 1."""
    dp_shard_size: int = 1
    """Ranks sharding weights, grads, optimizer state. Default 1; >= 1, or -1 = the ranks left."""
    tp_size: int = 1
    """Tensor-parallel ranks splitting each Linear of a layer. Default 1; >= 1."""
    cp_size: int = 1
    """Context-parallel ranks splitting the sequence. Default 1; >= 1."""
    pp_size: int = 1
    """Pipeline-parallel ranks, each holding a slice of the layer stack. Default 1; >= 1."""

    def _check_layout(self) -> None:
        for name in SIZE_FIELDS:
            setattr(self, name, _check_count(name, getattr(self, name), _NEUTRAL[name], size=True))

    @property
    def sizes(self) -> dict[str, int]:
        """Size per mesh dimension, outermost first: pp, dp_replicate, dp_shard, cp, tp."""
        return {name.removesuffix("_size"): getattr(self, name) for name in SIZE_FIELDS}

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: dp_replicate_size * dp_shard_size."""
        self._require_resolved("dp_size")
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def world_size(self) -> int:
        """Number of ranks the layout needs: the product of the five sizes."""
        self._require_resolved("world_size")
        return math.prod(self.sizes.values())

    def _require_resolved(self, what: str) -> None:
        if self.dp_shard_size == -1:
            raise ConfigError(f"{what} is unknown while dp_shard_size=-1 (the ranks left over); "
                              "call config = config.resolve(world_size) first")

    def _equation(self, skip: str = "") -> str:
        return " * ".join(f"{n}({getattr(self, n)})" for n in SIZE_FIELDS if n != skip)

    def resolve(self, world_size: int) -> Self:
        """A copy with dp_shard_size=-1 filled in, checked against `world_size` ranks."""
        if _is_int(world_size) and world_size >= 1:
            world_size = int(world_size)
        else:
            raise ConfigError(f"world_size={world_size!r} must be a positive integer")
        others = math.prod(getattr(self, n) for n in SIZE_FIELDS if n != "dp_shard_size")
        if self.dp_shard_size == -1:
            if world_size % others:
                raise ConfigError(
                    f"dp_shard_size=-1 takes the ranks left over, but the world size {world_size} "
                    f"is not divisible by {self._equation(skip='dp_shard_size')} = {others}; "
                    f"change those sizes so their product divides {world_size}")
            # replace() runs every check again, so options that depend on the layout (such as the deepspeed
            # pipeline's refusal of sharding) are re-checked against the filled-in size.
            resolved = dataclasses.replace(self, dp_shard_size=world_size // others)
        else:
            resolved = dataclasses.replace(self)
        if resolved.world_size != world_size:
            fix = (f"for example dp_shard_size={world_size // others}" if world_size % others == 0
                   else "dp_shard_size=-1 takes the ranks left over")
            raise ConfigError(
                f"{resolved._equation()} = {resolved.world_size}, but the world size is "
                f"{world_size}; change the sizes so their product is {world_size} ({fix})")
        return resolved
