"""The loss's option: cross-entropy in sequence chunks, so that the full logits are never held."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .checks import ConfigError, ConfigTypeError, _int_guess, _is_int, _kind

DEFAULT_LOSS_CHUNK_SIZE = 256
"""The most tokens per chunk under ``loss_chunk_size="auto"``: one chunk's fp32 logits at a 128k vocabulary are
128 MiB, 1/8 of the unchunked logits of 2048 tokens."""
AUTO_CHUNK_MIN = 128
"""The fewest tokens per chunk under "auto": below it the head's matmul per chunk gets small enough that the loop
over chunks, not the FLOPs, sets the loss's time."""
AUTO_CHUNK_FRACTION = 8
"""Under "auto" a chunk is at most 1/8 of the tokens the loss sees (issue 21: the logits term <= 1/8 of HF's)."""


def loss_chunk_for(value: Any, tokens: float) -> int:
    """Tokens per chunk for a loss that sees ``tokens`` tokens at once (b·s of this rank's call: after CP's sequence
    split, one micro-batch under PP), for the already checked setting ``value``; 0 = off.

    "auto" = ceil(tokens / 8) clamped to [128, 256]: 1/8 of the tokens where that is at least 128 (1024 to 2048
    tokens), 256 from 2048 tokens on (the logits term is then <= 1/8 already), 128 below 1024 tokens (a short loss
    holds little anyway). A positive int is that many tokens whatever ``tokens`` is."""
    if value == "auto":
        return min(DEFAULT_LOSS_CHUNK_SIZE, max(AUTO_CHUNK_MIN, math.ceil(tokens / AUTO_CHUNK_FRACTION)))
    return int(value or 0)


def resolve_loss_chunk_size(value: Any) -> int:
    """The most tokens per chunk ``value`` (an already checked setting) asks for, whatever the tokens: "auto" =
    256; 0 = off. The chunk a call uses is ``loss_chunk_for(value, tokens)``."""
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
    (default) = chosen at each loss call from the tokens that call sees (b·s after CP's split, one micro-batch under
    PP): 1/8 of them, at least 128 and at most 256 tokens (``loss_chunk_for``), so one chunk's logits are at most
    1/8 of the unchunked ones in every layout from 1024 tokens per call on; left off under TRL's SFTTrainer (it
    reads the logits). 0 or None = off (HF's loss on the full logits); a positive int = exactly that many tokens.
    Evaluation, calls without labels and generate always return the full logits."""

    def _check_loss(self) -> None:
        self.loss_chunk_size = check_loss_chunk_size(self.loss_chunk_size)

    @property
    def loss_chunk_tokens(self) -> int:
        """The most tokens per chunk (256 under "auto"); 0 = unchunked. A call's chunk: ``loss_chunk_for``."""
        return resolve_loss_chunk_size(self.loss_chunk_size)
