"""``fix_untrained_tokens``: give the embedding rows of untrained tokens that the training data uses a usable start.

Some checkpoints ship tokens whose embedding rows were never trained (zero rows, or added special tokens); a
training run that feeds them in starts from rows that carry nothing (or NaNs after the first step). This sets the
input-embedding and lm_head rows of those tokens, where the training data holds them, to the mean of the trained
rows, scaled by how often the token occurs relative to the most frequent token.

These are the semantics of Axolotl 0.19's ``fix_untrained_tokens`` (Unsloth's function, which Axolotl ships as
``axolotl.contribs.lgpl.fix_untrained_tokens``), written here because no library we depend on offers it; the tests
check the rows equal Axolotl's on the same model, tokenizer and data (tests/unit/test_untrained_tokens.py).
The YAML key maps onto ``token_ids`` as in Axolotl's ``train.py``: a list is passed as ``token_ids``; any other truthy
value (an int such as ``1`` or ``true``) runs the detection alone, ``token_ids=None`` (the int's value is not a
token id there); ``0``, ``[]`` or no key skip the fix.

It runs on the whole (unsharded) model, on every rank alike, before any layout is applied: it reads whole
embedding matrices and writes rows in place.

Where this differs from Axolotl's code, on purpose:
- frozen embeddings with untrained tokens in the data raise ``ConfigError``. Axolotl means to raise (a ValueError)
  but never does: it first re-wraps both weights as new ``nn.Parameter``s, which are trainable, so its frozen check
  cannot fire and it goes on to change the rows (leaving embed_tokens and lm_head trainable);
- rows are written into the existing weights, so ``requires_grad`` and tied embeddings (one Parameter) stay as they
  were; Axolotl's re-wrapping leaves two Parameters over one storage where the weights were tied;
- embedding matrices of different shapes, listed ids outside the embedding, and data ids outside
  ``max(len(tokenizer), rows)`` raise ``ConfigError`` (Axolotl truncates the wider matrix, or fails with an
  IndexError / shape error, or wraps negative ids).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from nd_parallel.config import ConfigError

FIRST_LOOK = 250  # rows read at each end of the data to decide whether it holds an untrained token
SECOND_LOOK = 2000  # rows read at each end before raising for frozen embeddings, when only the template named one
_FIX = "train the embeddings (lora_modules_to_save: [embed_tokens, lm_head]) or drop fix_untrained_tokens"


def fix_untrained_tokens(model, tokenizer, input_ids: Iterable[Sequence[int]], token_ids: list[int] | None = None,
                         eps: float = 1e-16) -> list[int]:
    """Set the embedding and lm_head rows of untrained tokens seen in ``input_ids`` to the scaled trained mean.

    A row is untrained when its input-embedding row's maximum (signed, not absolute) is ``<= eps`` and its lm_head
    row's maximum is too, or its lm_head row (rounded to 3 decimals) repeats another such row's; the tokenizer's
    pad token never is. ``token_ids`` adds ids to fix whatever their rows hold. Nothing changes unless one of
    these tokens is in the tokenizer's chat template or in the first or last 250 rows of ``input_ids``; then
    every one seen anywhere in ``input_ids`` gets ``mean * count / max count`` (the mean of the rows not
    fixed, the count over all rows, the max over all tokens). Returns the token ids whose rows were changed
    (sorted, ``[]`` when none). Raises ``ConfigError`` when such tokens are in the data but the weights are frozen.
    """
    embed, head = _weights(model)
    template = getattr(tokenizer, "chat_template", None)
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a processor: its tokenizer
    rows = embed.shape[0]
    detected = _untrained_rows(embed, head, tok, eps)
    listed = _listed_ids(token_ids, rows)
    # The order is that of a Python set of the listed then the detected ids: it is the order Axolotl sums the rows
    # it leaves out of the mean in, which changes the float32 sums' last bits when those rows are not zero.
    candidates = list(set(listed + detected))
    if not candidates:
        return []
    names = [t for t in tok.convert_ids_to_tokens(candidates) if t is not None]
    in_template = template is not None and any(name in template for name in names)
    scan = _scan(input_ids, max(len(tok), rows))
    wanted = frozenset(candidates)
    in_ends = _found(scan.head[:FIRST_LOOK], wanted) or _found(list(scan.tail)[-FIRST_LOOK:], wanted)
    if not (in_template or in_ends):
        return []
    if not (embed.requires_grad and head.requires_grad):
        _raise_if_frozen_tokens_used(scan, wanted)
        return []
    counts = scan.counts_or_raise()
    seen = [(t, int(counts[t])) for t in candidates if counts[t] > 0]
    if not seen:
        return []
    peak = max(int(counts.max()), 1)
    # counts / peak in float64 times the float32 mean is a float64 product, rounded once to the weight's dtype
    scale = torch.tensor([n / peak for _, n in seen], dtype=torch.float64, device=embed.device).unsqueeze(1)
    ids = [t for t, _ in seen]
    n_trained = rows - len(detected)  # listed ids are left out of the sum but not out of this count (as Axolotl)
    new_embed = (_mean_without(embed, candidates, n_trained).double().unsqueeze(0) * scale).to(embed.dtype)
    new_head = (_mean_without(head, candidates, n_trained).double().unsqueeze(0) * scale).to(head.dtype)
    with torch.no_grad():
        embed[ids] = new_embed
        head[ids] = new_head  # tied embeddings: the same rows again, with the same values
    return sorted(ids)


def _weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The input-embedding and lm_head weights (the same Parameter when tied), checked to be whole and alike."""
    embedding, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or lm_head is None:
        raise ConfigError("fix_untrained_tokens needs a model with input and output embeddings (an lm_head); "
                          f"{type(model).__name__} has {'no input' if embedding is None else 'no output'} embeddings: "
                          "drop fix_untrained_tokens")
    embed, head = embedding.weight, lm_head.weight
    if embed.is_meta or head.is_meta or embed.shape[0] == 0 or head.shape[0] == 0:
        raise ConfigError(f"fix_untrained_tokens needs the whole embedding matrices, got embed_tokens "
                          f"{tuple(embed.shape)} and lm_head {tuple(head.shape)} (meta={embed.is_meta}): "
                          "run it on the loaded, unsharded model before the layout is applied")
    if embed.shape != head.shape:
        raise ConfigError(f"fix_untrained_tokens: embed_tokens {tuple(embed.shape)} and lm_head {tuple(head.shape)} "
                          "differ in shape, so their rows cannot be fixed alike: drop fix_untrained_tokens")
    return embed, head


@torch.no_grad()
def _untrained_rows(embed: torch.Tensor, head: torch.Tensor, tok, eps: float) -> list[int]:
    """Ascending ids of the rows that look untrained on both sides (the pad token excepted)."""
    low_embed = embed.amax(dim=1) <= eps
    low_head = (head.amax(dim=1) <= eps).clone()
    # lm_head rows of the low embedding rows that repeat one another (to 3 decimals, as float32 bytes, so 0.0 and
    # -0.0 differ) count as untrained too: a maximum near zero misses Llama 3.1's untrained rows.
    low_ids = torch.nonzero(low_embed).flatten().tolist()
    keys = [row.tobytes() for row in np.round(head[low_ids].cpu().float().numpy(), 3)]
    times = Counter(keys)
    low_head[[i for i, key in zip(low_ids, keys) if times[key] >= 2]] = True
    untrained = low_embed & low_head
    pad = getattr(tok, "pad_token_id", None)
    if pad is not None and pad < untrained.shape[0]:
        untrained[pad] = False
    return torch.nonzero(untrained).flatten().tolist()


def _listed_ids(token_ids, rows: int) -> list[int]:
    listed = list(token_ids or [])
    wrong = [t for t in listed if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < rows]
    if wrong:
        raise ConfigError(f"fix_untrained_tokens: token ids {wrong} are not rows of the embedding (0..{rows - 1}): "
                          "list ids of the model's vocabulary")
    return listed


class _Scan:
    """One pass over the data: the first and last SECOND_LOOK rows and every token's count."""

    def __init__(self, size: int):
        self.size, self.head, self.tail = size, [], deque(maxlen=SECOND_LOOK)
        self.counts = np.zeros(size, dtype=np.int64)
        self.outside: set[int] = set()
        self._pending: list[np.ndarray] = []
        self._pending_len = 0

    def add(self, row) -> None:
        ids = np.asarray(row, dtype=np.int64).ravel()
        as_list = ids.tolist()
        if len(self.head) < SECOND_LOOK:
            self.head.append(as_list)
        self.tail.append(as_list)
        self._pending.append(ids)
        self._pending_len += ids.size
        if self._pending_len >= 1 << 20:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        ids = np.concatenate(self._pending)
        self._pending, self._pending_len = [], 0
        inside = (ids >= 0) & (ids < self.size)
        if not inside.all() and len(self.outside) < 20:
            self.outside.update(ids[~inside][:20].tolist())
        self.counts += np.bincount(ids[inside], minlength=self.size)

    def counts_or_raise(self) -> np.ndarray:
        if self.outside:
            raise ConfigError(f"fix_untrained_tokens: the training data holds token ids {sorted(self.outside)} outside "
                              f"0..{self.size - 1} (max of the tokenizer length and the embedding rows): "
                              "tokenize the data with the model's tokenizer")
        return self.counts


def _scan(input_ids: Iterable[Sequence[int]], size: int) -> _Scan:
    scan = _Scan(size)
    for row in input_ids:
        scan.add(row)
    scan.flush()
    return scan


def _found(rows: list[list[int]], wanted: frozenset[int]) -> bool:
    return any(t in wanted for row in rows for t in row)


def _raise_if_frozen_tokens_used(scan: _Scan, wanted: frozenset[int]) -> None:
    """Frozen weights: raise naming the untrained ids in the first/last 250 rows, else in the first/last 2000 rows
    (the chat template named one); none there either is taken for a false signal and changes nothing."""
    tail = list(scan.tail)
    for look in (FIRST_LOOK, SECOND_LOOK):
        used = sorted({t for row in scan.head[:look] + tail[-look:] for t in row if t in wanted})
        if used:
            raise ConfigError(f"fix_untrained_tokens: untrained token ids {used} occur in the training data but "
                              f"embed_tokens / lm_head are frozen, so their rows cannot learn: {_FIX}")


def _mean_without(weight: torch.Tensor, left_out: list[int], n_trained: int) -> torch.Tensor:
    """float32 (sum of all rows - sum of the left-out rows, in that order) / n_trained."""
    with torch.no_grad():
        total = torch.sum(weight, dim=0, dtype=torch.float32)
        total -= torch.sum(weight[left_out], dim=0, dtype=torch.float32)
        return total / n_trained
