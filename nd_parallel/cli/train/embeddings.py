"""Axolotl's keys about the embedding table's rows, applied on each rank to the whole model after loading and before
the adapter and the layout:

- the table grows to the tokenizer's length (rounded up to 32 with ``resize_token_embeddings_to_32x``; new rows
  from the old rows' mean with ``mean_resizing_embeddings``), and with ``shrink_embeddings`` it also shrinks to it:
  rows past the tokenizer's last id are dropped (Axolotl's ``_resize_token_embeddings``);
- ``fix_untrained_tokens``: rows that look untrained and occur in the training data start from the mean of the
  trained rows (nd_parallel/models/untrained_tokens.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class EmbeddingOptions:
    shrink_embeddings: bool = False
    """Shrink the embedding table (and a tied or untied lm_head) to the tokenizer's length when it is larger
    (Axolotl's meaning; rounded up to 32 with resize_token_embeddings_to_32x)."""
    fix_untrained_tokens: bool | int | list[int] | None = None
    """Rows of untrained tokens the training data uses start from the trained rows' mean, scaled by frequency
    (Axolotl's, i.e. Unsloth's, fix): a list adds those token ids to the detected ones; true (or an int, as Axolotl
    reads it) detects only."""


def refusals(d: dict) -> list[str]:
    out = []
    value = d.get("shrink_embeddings")
    if value is not None and not isinstance(value, bool):
        out.append(f"shrink_embeddings={value!r}; use true or false")
    fix = d.get("fix_untrained_tokens")
    if fix is not None and not (isinstance(fix, (bool, int)) or isinstance(fix, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in fix)):
        out.append(f"fix_untrained_tokens={fix!r}: write true (detect the untrained rows) or a list of token ids "
                   "to fix besides them")
    return out


def notes(d: dict) -> list[str]:
    """An int fix_untrained_tokens is read as Axolotl's train.py reads it: detection only, not a token id."""
    fix = d.get("fix_untrained_tokens")
    if isinstance(fix, int) and not isinstance(fix, bool) and fix:
        return [f"fix_untrained_tokens={fix}: read as Axolotl 0.19 reads an int, as true (the untrained rows are "
                f"detected), not as token id {fix}; write [{fix}] to fix that token too"]
    return []


def fix_untrained(model, t, tokenizer, train_ds) -> list[int]:
    """fix_untrained_tokens on the whole model (adapter attached, before the layout), with the training rows."""
    if not t.fix_untrained_tokens:
        return []
    from nd_parallel.models.untrained_tokens import fix_untrained_tokens

    listed = t.fix_untrained_tokens if isinstance(t.fix_untrained_tokens, list) else None
    return fix_untrained_tokens(model, tokenizer, train_ds["input_ids"], token_ids=listed)


def rows_wanted(t, tokenizer_len: int) -> int:
    """Rows the input embeddings need (Axolotl's _resize_token_embeddings)."""
    return math.ceil(tokenizer_len / 32) * 32 if t.resize_token_embeddings_to_32x else tokenizer_len


def resize(model, t, tokenizer_len: int) -> None:
    """Grow the table to the tokenizer (special_tokens / tokens added ids), or shrink it with shrink_embeddings."""
    rows, have = rows_wanted(t, tokenizer_len), model.get_input_embeddings().num_embeddings
    if rows > have or (rows < have and t.shrink_embeddings):
        # Axolotl passes mean_resizing (default False: transformers' own default, True, starts the new rows elsewhere)
        model.resize_token_embeddings(rows, mean_resizing=t.mean_resizing_embeddings)
