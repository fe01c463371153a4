"""Activation checkpointing's options: which mode recomputes activations in backward, and on how many layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import ConfigError, _check_count

AC_MODES = (None, "full", "selective")


def check_activation_checkpointing(mode: Any) -> None:
    """One of AC_MODES, or a ConfigError naming the value and the modes."""
    if mode not in AC_MODES:
        raise ConfigError(f"activation_checkpointing={mode!r} is not a mode; use None (off), 'full' (recompute "
                          "each decoder layer) or 'selective' (keep matmul and attention outputs, recompute the rest)")


@dataclass(kw_only=True)
class ActivationCheckpointingOptions:
    """Trading compute for memory: activations recomputed in backward instead of kept from forward."""

    activation_checkpointing: str | None = None
    """Recompute activations in backward: None (default, off), "full" (each decoder layer keeps only its input)
    or "selective" (keep matmul/attention outputs, recompute norms, activations, elementwise ops)."""
    activation_checkpointing_every: int = 1
    """Checkpoint every k-th decoder layer of each model part. Default 1 (all); >= 1."""

    def _check_activation_checkpointing(self) -> None:
        check_activation_checkpointing(self.activation_checkpointing)
        self.activation_checkpointing_every = _check_count(
            "activation_checkpointing_every", self.activation_checkpointing_every,
            "activation_checkpointing_every=1 to checkpoint every layer")
