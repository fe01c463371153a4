"""The loss's option: cross-entropy in sequence chunks, so that the full logits are never held."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import ConfigError, ConfigTypeError, _int_guess, _is_int, _kind

DEFAULT_LOSS_CHUNK_SIZE = 256
"""Tokens per chunk under ``loss_chunk_size="auto"``: one chunk's fp32 logits at a 128k vocabulary are 128 MiB, and
at sequence 2048 (one sample) the logits term is 1/8 of the unchunked one."""


def resolve_loss_chunk_size(value: Any) -> int:
    """The number of tokens per chunk that ``value`` (an already checked setting) asks for; 0 = off."""
    if value == "auto":
        return DEFAULT_LOSS_CHUNK_SIZE
    return int(value or 0)


def check_loss_chunk_size(value: Any) -> Any:
    """"auto", None, 0 or a positive int; anything else is a ConfigError naming the value and the fix."""
    if value is None or value == "auto":
        return value
    if not _is_int(value):
        guess = None if isinstance(value, bool) else _int_guess(value)
        fix = f"write loss_chunk_size={guess}" if guess is not None and guess >= 0 else \
            f"use loss_chunk_size={DEFAULT_LOSS_CHUNK_SIZE} (tokens per chunk), 0 or None (off) or 'auto'"
        raise ConfigTypeError(f"loss_chunk_size={value!r} is {_kind(value)}; it is a number of tokens per "
                              f"chunk, {fix}")
    if value < 0:
        raise ConfigError(f"loss_chunk_size={value} must be a positive number of tokens per chunk; use "
                          f"loss_chunk_size={DEFAULT_LOSS_CHUNK_SIZE}, or 0 / None to compute the loss unchunked")
    return int(value)


@dataclass(kw_only=True)
class LossOptions:
    """How the causal-LM loss is computed in training."""

    loss_chunk_size: int | str | None = "auto"
    """Tokens per chunk of the chunked cross-entropy: the head and log-softmax run one chunk at a time, so only one
    chunk's logits are ever alive, and ``outputs.logits`` is None in a training forward with labels. "auto"
    (default) = 256 tokens, left off under TRL's SFTTrainer (it reads the logits); 0 or None = off (HF's loss on
    the full logits); a positive int = that many tokens. Evaluation, calls without labels and generate always
    return the full logits."""

    def _check_loss(self) -> None:
        self.loss_chunk_size = check_loss_chunk_size(self.loss_chunk_size)

    @property
    def loss_chunk_tokens(self) -> int:
        """The resolved chunk size in tokens; 0 = unchunked."""
        return resolve_loss_chunk_size(self.loss_chunk_size)
