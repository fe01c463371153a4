"""Sample packing: whole samples laid back to back in rows of at most sequence_len tokens.

Each sample keeps its own position ids (0, 1, ... restarting at every sample; PoSE's skipped ones where use_pose gave
them), and there is no attention mask:
transformers' masks, nd_parallel's ring attention (CP) and pipeline stages (PP) read the restarts as document
boundaries, so attention stays inside a sample. A sample's first label is ignored (-100): it would otherwise be
predicted from the previous sample's last token. In a sample of its own it is never predicted either (the loss
shifts labels by one), so packing changes neither what is learned nor the token count.
"""

from __future__ import annotations

from nd_parallel.distributed.loss import IGNORE_INDEX


def pack_fn(sequence_len: int):
    """A batched `map` function: rows of input_ids/labels -> packed rows with position_ids (greedy, in order)."""

    def pack(batch):
        out = {"input_ids": [], "labels": [], "position_ids": []}
        row = {k: [] for k in out}
        given = batch.get("position_ids") or [None] * len(batch["input_ids"])  # PoSE's (pose.py), if any
        for ids, labels, positions in zip(batch["input_ids"], batch["labels"], given):
            if row["input_ids"] and len(row["input_ids"]) + len(ids) > sequence_len:
                for k in out:
                    out[k].append(row[k])
                row = {k: [] for k in out}
            append_sample(row, ids, labels, positions)
        if row["input_ids"]:
            for k in out:
                out[k].append(row[k])
        return out

    return pack


def append_sample(row: dict, ids, labels, positions=None) -> None:
    """Lay one sample at the end of `row` (input_ids / labels / position_ids lists): its first label ignored, its
    positions its own (PoSE's) or 0, 1, ...: the layout of packed rows and of batch_flattening's row (collate.py)."""
    row["input_ids"] += list(ids)
    row["labels"] += [IGNORE_INDEX] + list(labels[1:])
    row["position_ids"] += list(positions) if positions is not None else list(range(len(ids)))
