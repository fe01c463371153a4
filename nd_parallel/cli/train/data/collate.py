"""Batches: right padding (labels -100), to the longest row or to sequence_len, for the Trainer (`Collator`);
stacking rows that are already padded, for an Accelerate loop (`collate`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nd_parallel.distributed.loss import IGNORE_INDEX

from .packing import append_sample


@dataclass
class Collator:
    pad_id: int
    pad_to: int | None = None
    """Pad every batch to this length (pad_to_sequence_len / sample_packing), else to its longest row."""
    multiple: int | None = None
    """The longest row's length rounded up to a multiple of this (pad_to_multiple_of)."""
    flatten: bool = False
    """The batch as one row of its samples back to back (batch_flattening), each with its own position ids."""

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.flatten:
            return self._flat(rows)
        longest = max(len(r["input_ids"]) for r in rows)
        length = self.pad_to or (-(-longest // self.multiple) * self.multiple if self.multiple else longest)
        packed = "position_ids" in rows[0]
        out = {"input_ids": [], "labels": [], ("position_ids" if packed else "attention_mask"): []}
        for r in rows:
            ids, pad = list(r["input_ids"]), length - len(r["input_ids"])
            out["input_ids"].append(ids + [self.pad_id] * pad)
            out["labels"].append(list(r["labels"]) + [IGNORE_INDEX] * pad)
            if packed:  # the padding is one more "document" (positions from 0) that no real token attends to
                out["position_ids"].append(list(r["position_ids"]) + list(range(pad)))
            else:
                out["attention_mask"].append([1] * len(ids) + [0] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}

    @staticmethod
    def _flat(rows: list[dict]) -> dict[str, torch.Tensor]:
        """transformers' DataCollatorWithFlattening's layout, which is a packed row's (packing.append_sample): the
        first label of each sample is -100 (it would be predicted from the previous sample); positions restart at
        each sample, so its attention stays inside it."""
        out = {"input_ids": [], "labels": [], "position_ids": []}
        for r in rows:
            append_sample(out, r["input_ids"], r["labels"], r.get("position_ids"))
        return {k: torch.tensor([v], dtype=torch.long) for k, v in out.items()}


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Rows of equal-length tensors (`build_samples`'s) stacked into one batch."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
