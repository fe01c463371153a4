"""Which tokens of a sequence each context-parallel rank holds, and the batch cut into those shares.

Pure tensor code, no collective: every rank cuts the same full batch, so each rank also knows what every
other rank holds (the attention kernels need that to mask the K/V blocks that travel around the ring).

Load balancing: under a causal mask, token i attends to i+1 keys, so contiguous shards give the last rank
about 2*cp-1 times the work of the first. Cutting the sequence into 2*cp chunks and giving rank r chunks r
and 2*cp-1-r pairs a cheap chunk with an expensive one, so every rank does the same work (the scheme of
Megatron-LM and torchtitan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nd_parallel.models.hf import text_config

IGNORE_INDEX = -100


def num_chunks(cp: int, load_balance: bool) -> int:
    return 2 * cp if load_balance else cp


def padded_length(seq_len: int, cp: int, load_balance: bool) -> int:
    """The sequence length rounded up so that it splits into equal chunks."""
    n = num_chunks(cp, load_balance)
    return -(-seq_len // n) * n


def rank_chunks(rank: int, cp: int, load_balance: bool) -> tuple[int, ...]:
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def token_index(rank: int, cp: int, padded_len: int, load_balance: bool, device=None) -> torch.Tensor:
    """Global positions (in the padded sequence) of the tokens ``rank`` holds, in its local order."""
    size = padded_len // num_chunks(cp, load_balance)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in rank_chunks(rank, cp, load_balance)])


def check_sequence(seq_len: int, cp: int, load_balance: bool) -> None:
    """Refuse sequences too short to give every rank at least one real token per chunk."""
    n = num_chunks(cp, load_balance)
    if seq_len < n:
        lb = " with cp_load_balance=True (2 chunks per rank)" if load_balance else ""
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be split over cp_size={cp}{lb}: it needs at least {n} "
            f"tokens; use longer sequences, a smaller cp_size" + (", or cp_load_balance=False" if load_balance else "")
        )


def isolates_documents(model_config, use_cache) -> bool:
    """Whether transformers masks packed documents apart in a forward called with ``use_cache``.

    transformers detects packing (position ids that restart) only when the forward builds no KV cache: with
    the default use_cache=True (config.use_cache) tokens of a packed row attend across document boundaries.
    Context parallelism and pipeline stages reproduce whichever the single-process forward does.
    """
    if use_cache is None:
        use_cache = getattr(text_config(model_config), "use_cache", False)
    return not use_cache


def packed_documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document ids of packed rows (position ids restart per document), or None when no row is packed.

    The rule is transformers' own (masking_utils.find_packed_sequence_indices), so a packed batch is masked
    exactly as the single-process model masks it: it applies only when no attention_mask is given.
    """
    from transformers.masking_utils import find_packed_sequence_indices

    return find_packed_sequence_indices(position_ids)


@dataclass
class ShardedBatch:
    """One rank's share of a batch, plus what every rank needs to mask every other rank's keys."""

    kwargs: dict            # model inputs for this rank: local input_ids / position_ids / labels / shift_labels
    valid: torch.Tensor     # bool (B, S_pad): real tokens of the full (padded) sequence
    doc: torch.Tensor | None  # int64 (B, S_pad) document ids of packed rows, or None
    seq_len: int            # length before padding
    padded_len: int


def _pad(t: torch.Tensor, length: int, value) -> torch.Tensor:
    extra = length - t.shape[1]
    if extra == 0:
        return t
    pad = t.new_full((t.shape[0], extra, *t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def shard_batch(inputs: dict, rank: int, cp: int, load_balance: bool, pad_token_id: int = 0,
                isolate_documents: bool = True) -> ShardedBatch:
    """Cut ``inputs`` (the keyword arguments of a causal-LM forward) into ``rank``'s share of the sequence.

    - input_ids / inputs_embeds / position_ids: the rank's tokens; position ids stay the global ones, so RoPE
      and learned positions see the same values as in one process.
    - labels: shifted *before* the cut (token t predicts t+1, which may live on another rank) and handed to
      transformers' loss as ``shift_labels``; ``labels`` carries the same tensor so the model computes a loss.
    - attention_mask: becomes ``valid`` (key padding, travels with the keys' metadata); the model itself gets
      none, the CP attention builds the mask from global token positions.
    - A length that does not split evenly is padded at the end with invalid, unlabelled tokens.
    - Packed rows (position ids restart, no attention_mask) get document ids when ``isolate_documents``
      (see isolates_documents: what transformers itself does for the same call).
    """
    inputs = dict(inputs)
    ids, embeds = inputs.pop("input_ids", None), inputs.pop("inputs_embeds", None)
    ref = ids if ids is not None else embeds
    if ref is None:
        raise ValueError("context parallelism needs input_ids or inputs_embeds in the batch")
    batch, seq_len = ref.shape[0], ref.shape[1]
    check_sequence(seq_len, cp, load_balance)
    padded = padded_length(seq_len, cp, load_balance)
    device = ref.device

    mask = inputs.pop("attention_mask", None)
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"context parallelism takes a 2-D attention_mask (batch, sequence) of 0/1 padding flags; got a "
            f"{mask.dim()}-D mask of shape {tuple(mask.shape)}. Pass the padding mask (or position_ids for packed "
            "documents) and let the CP attention build the causal mask"
        )
    valid = mask.bool() if mask is not None else torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    valid = _pad(valid, padded, False)

    positions = inputs.pop("position_ids", None)
    doc = None
    if positions is not None:
        positions = positions.expand(batch, -1) if positions.shape[0] != batch else positions
        if mask is None and isolate_documents:
            doc = packed_documents(positions)
            if doc is not None:
                doc = _pad(doc, padded, -1)
    else:
        positions = torch.arange(seq_len, device=device).expand(batch, -1)
    if padded > seq_len:  # padding continues the positions (finite rotary angles); its keys are masked out
        tail = positions[:, -1:] + torch.arange(1, padded - seq_len + 1, device=device)
        positions = torch.cat([positions, tail], dim=1)

    labels, shift = inputs.pop("labels", None), inputs.pop("shift_labels", None)
    if shift is None and labels is not None:
        shift = _pad(labels[:, 1:], padded, IGNORE_INDEX)
    elif shift is not None:
        shift = _pad(shift, padded, IGNORE_INDEX)

    index = token_index(rank, cp, padded, load_balance, device)
    out = dict(inputs)
    if ids is not None:
        out["input_ids"] = _pad(ids, padded, pad_token_id)[:, index]
    if embeds is not None:
        out["inputs_embeds"] = _pad(embeds, padded, 0.0)[:, index]
    out["position_ids"] = positions[:, index]
    if shift is not None:
        out["labels"] = out["shift_labels"] = shift[:, index].contiguous()
    return ShardedBatch(out, valid, doc, seq_len, padded)


def unshard(pieces: list[torch.Tensor], seq_len: int, load_balance: bool) -> torch.Tensor:
    """Put every rank's shard (dim 1 = local sequence; pieces[r] from cp rank r) of an output back in sequence
    order, padding removed."""
    cp, first = len(pieces), pieces[0]
    padded = first.shape[1] * cp
    full = first.new_empty((first.shape[0], padded, *first.shape[2:]))
    for r, piece in enumerate(pieces):
        full[:, token_index(r, cp, padded, load_balance, first.device)] = piece
    return full[:, :seq_len]
