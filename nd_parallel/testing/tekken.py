"""A tiny mistral-common tokenizer file (tekken.json), built locally: no hub.

The format is mistral-common's (tokens/tokenizers/tekken.py): a config (tiktoken's split pattern, the vocabulary
and special-token counts, the tokenizer version), the vocabulary as base64 bytes ranked by merge order (the 256
single bytes first, as tiktoken needs them), and the special tokens, which take the first ids. Here: the 256 bytes,
the byte-pair merges learned from a few texts, and mistral-common's special tokens (padded to `specials` with its
<SPECIAL_n> fillers).
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

# Tekken's own split pattern (letters with an optional leading non-letter, digits one by one, punctuation, spaces).
PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
           r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")


def _merges(texts: list[str], count: int) -> list[bytes]:
    """`count` byte-pair merges, most frequent pair first, learned on the words of `texts` (plain BPE)."""
    words = Counter(tuple(bytes([b]) for b in (" " + w).encode()) for t in texts for w in t.split())
    merges = []
    while len(merges) < count:
        pairs = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        merges.append(a + b)
        merged = Counter()
        for word, n in words.items():
            out, k = [], 0
            while k < len(word):
                if k + 1 < len(word) and (word[k], word[k + 1]) == (a, b):
                    out.append(a + b)
                    k += 2
                else:
                    out.append(word[k])
                    k += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def write_tiny_tekken(path: str | Path, texts: list[str], *, merges: int = 24, specials: int = 40,
                      version: str = "v7") -> int:
    """Write tekken.json at `path`; return its vocabulary size (specials + 256 bytes + merges)."""
    from mistral_common.tokens.tokenizers.base import SpecialTokens

    learned = _merges(texts, merges)
    tokens = [bytes([b]) for b in range(256)] + learned
    vocab = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
             for i, t in enumerate(tokens)]
    named = [{"rank": i, "token_str": str(t), "is_control": True} for i, t in enumerate(SpecialTokens)]
    data = {"config": {"pattern": PATTERN, "num_vocab_tokens": len(vocab), "default_vocab_size": len(vocab) + specials,
                       "default_num_special_tokens": specials, "version": version},
            "vocab": vocab, "special_tokens": named[:specials], "version": 1, "type": "Tekken"}
    Path(path).write_text(json.dumps(data))
    return len(vocab) + specials
