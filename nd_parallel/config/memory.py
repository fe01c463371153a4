"""Memory options: parameters offloaded to host memory, activations offloaded to host memory, the MLP in tiles.

Each trades time (host transfers, recomputation) for device memory and leaves the numbers of training unchanged:
the parity tests hold every option to the run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import ConfigError, _check_bool, _check_count


@dataclass(kw_only=True)
class MemoryOptions:
    """Where parameters and activations live between their uses, and how the MLP's activations are bounded."""

    fsdp_offload_params: bool = False
    """Keep the sharded parameters, their gradients and the optimizer step on the host (FSDP2's
    ``CPUOffloadPolicy``); each layer's shard is copied to the device for its forward and backward. Default False.
    On a CPU-only run the device is the host: the policy is set, nothing moves."""
    activation_offloading: bool = False
    """Move the tensors each decoder layer saves for backward to host memory during forward and back for its
    backward (saved-tensor hooks). With activation checkpointing, what is moved is each layer's checkpointed
    input (Axolotl's ``gradient_checkpointing: offload``). Default False. On a CPU-only run nothing moves."""
    tiled_mlp: bool = False
    """Compute each decoder layer's MLP over the sequence in tiles, each recomputed in backward, so that the
    MLP's intermediate activations exist for one tile at a time. Default False."""
    tiled_mlp_num_shards: int | None = None
    """Tiles per sequence with tiled_mlp. Default None: ceil(tokens / hidden_size), at least 1; >= 1."""

    def _check_memory(self) -> None:
        for name in ("fsdp_offload_params", "activation_offloading", "tiled_mlp"):
            _check_bool(name, getattr(self, name))
        if self.tiled_mlp_num_shards is not None:
            self.tiled_mlp_num_shards = _check_count("tiled_mlp_num_shards", self.tiled_mlp_num_shards,
                                                     "tiled_mlp_num_shards=None (one tile per hidden_size tokens)")
            if not self.tiled_mlp:
                raise ConfigError(f"tiled_mlp_num_shards={self.tiled_mlp_num_shards} without tiled_mlp=True; set "
                                  "tiled_mlp=True, or drop tiled_mlp_num_shards")
        if self.fsdp_offload_params and getattr(self, "pp_backend", "torch") == "deepspeed":
            raise ConfigError("fsdp_offload_params=True with pp_backend='deepspeed': DeepSpeed's pipeline engine "
                              "holds its stages itself, not through FSDP2; use pp_backend='torch' with "
                              "fsdp_offload_params, or drop fsdp_offload_params")
