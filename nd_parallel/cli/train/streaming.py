"""Axolotl's streamed data (``pretraining_dataset``, ``streaming: true``) and ``reinit_weights``, config side.

What is streamed, and when: in the parent, before any rank starts (data/streamed.py). The one `datasets:` entry
(``pretraining_dataset`` becomes that entry) is opened with datasets' ``streaming=True`` (a hub name, or local
files), skipped, shuffled in a buffer of ``streaming_multipack_buffer_size`` records, tokenized and packed chunk by
chunk, and read only until the run's ``max_steps x micro_batch_size x gradient_accumulation_steps x dp`` rows are
made. Those rows are written like any prepared data, so every rank sees the same global batches as one process
(the prepared dataloader splits each global batch over the dp ranks, as for files). A stream that ends before is
passed over again, as the Trainer does with a stream.

``reinit_weights`` (rank.py): the model is built from the checkpoint's config with its own ``_init_weights`` under
the run's seed (the same weights on every rank and layout); the checkpoint's weights are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import data_options
from .data.sources import suggest
from .data_options import DataOptions

# Axolotl's PretrainingDataset keys (its SFT keys name the same fields: field for text_column, ds_type)
PRETRAINING_KEYS = ("path", "name", "split", "text_column", "field", "type", "data_files", "skip",
                    "trust_remote_code", "ds_type")
PRETRAINING_TYPES = {"pretrain": "pretraining", "pretraining": "pretraining", None: "pretraining",
                     "completion": "completion"}


@dataclass(kw_only=True)
class StreamingOptions(DataOptions):  # and excess_length_strategy, dataset_shard_* (data_options.py)
    streaming: bool = False
    """Stream the datasets entry (datasets' streaming=True), reading only the records the run's max_steps needs.
    Set by pretraining_dataset (Axolotl turns streaming on for it too)."""
    pretraining_dataset: list | None = None
    """Axolotl's streamed pretraining source, [{path, name, split, text_column, type: pretrain, data_files,
    skip}]: read as the one streamed datasets entry, its texts cut into Axolotl's pretraining windows."""
    streaming_multipack_buffer_size: int = 10000
    """Records in the stream's shuffle buffer, and tokenized and packed together (Axolotl's). Default 10000."""
    pretrain_multipack_buffer_size: int | None = None
    """Axolotl's older name of streaming_multipack_buffer_size."""
    pretrain_multipack_attn: bool = True
    """pretraining_dataset with sample_packing: each packed document attends to itself only (per-document position
    ids); false: the documents of a row attend to each other. Default true."""
    pretraining_sample_concatenation: bool | None = None
    """pretraining_dataset without sample_packing: documents concatenated into sequence_len rows (attending to each
    other) instead of one per row."""
    reinit_weights: bool = False
    """Train from the model config's own random init (seeded) instead of the checkpoint's weights."""


def streaming_refusals(d: dict) -> list[str]:
    """Check the keys above in the YAML mapping `d`; a pretraining_dataset becomes the streamed `datasets:` entry
    (in place). Refusal lines, each with its fix (Axolotl's own rules where it has one)."""
    out = data_options.refusals(d)
    out += [f"{key}={d[key]!r}; use true or false" for key in ("streaming", "pretrain_multipack_attn",
                                                               "pretraining_sample_concatenation", "reinit_weights")
           if d.get(key) is not None and not isinstance(d[key], bool)]
    old = d.pop("pretrain_multipack_buffer_size", None)
    if old is not None:
        if d.get("streaming_multipack_buffer_size", old) != old:
            out.append("pretrain_multipack_buffer_size and streaming_multipack_buffer_size both set: keep "
                       "streaming_multipack_buffer_size (the other is its older name)")
        d["streaming_multipack_buffer_size"] = old
    size = d.get("streaming_multipack_buffer_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        out.append(f"streaming_multipack_buffer_size={size!r}; write a number of records >= 1")
    if d.get("pretraining_dataset"):
        out += _pretraining_entry(d)
    if d.get("streaming"):
        out += _streaming_rules(d)
    else:
        out += [f"datasets[{i}].skip: only a streamed dataset skips records; set streaming: true, or drop it"
                for i, entry in enumerate(d.get("datasets") or []) if isinstance(entry, dict) and entry.get("skip")]
    if d.get("reinit_weights") is True and (d.get("load_in_4bit") or d.get("load_in_8bit")
                                            or d.get("quantize_moe_experts")):
        out.append("reinit_weights with a quantized base (load_in_4bit / load_in_8bit / quantize_moe_experts): a "
                   "random init has no checkpoint to quantize; drop reinit_weights or the quantization")
    return out


def _pretraining_entry(d: dict) -> list[str]:
    """Axolotl's pretraining_dataset (a name, a mapping or a list of them) as the one streamed datasets entry."""
    given = d["pretraining_dataset"]
    entries = [given] if isinstance(given, (str, dict)) else given
    if not isinstance(entries, list) or not all(isinstance(e, (str, dict)) for e in entries):
        return [f"pretraining_dataset={given!r}; write a list of {{path, name, split, text_column, type: pretrain}}"]
    entries = [{"path": e} if isinstance(e, str) else dict(e) for e in entries]
    d["pretraining_dataset"] = entries
    out = []
    if len(entries) > 1:  # Axolotl streams pretraining_dataset[0] and drops the rest without a word
        out.append(f"pretraining_dataset has {len(entries)} entries; Axolotl streams only the first: keep one (list "
                   "several local files in its data_files)")
    if d.get("datasets") is not None:
        out.append("pretraining_dataset together with datasets: Axolotl then trains on pretraining_dataset alone; "
                   "keep one of them")
    entry = entries[0]
    out += [f"unknown key {key!r} in pretraining_dataset[0]; {suggest(key, PRETRAINING_KEYS)}"
            for key in entry if key not in PRETRAINING_KEYS]
    if entry.get("type") not in PRETRAINING_TYPES:
        out.append(f"pretraining_dataset[0].type={entry['type']!r}: use pretrain (Axolotl's pretraining windows) or "
                   "completion")
    if not isinstance(entry.get("path"), str):
        out.append("pretraining_dataset[0] needs a 'path': a hub dataset name or local files")
    if out:
        return out
    text = entry.get("text_column") or entry.get("field") or "text"
    spec = {"path": entry["path"], "type": PRETRAINING_TYPES[entry.get("type")], "field": text,
            "split": entry.get("split") or "train", "name": entry.get("name"), "skip": entry.get("skip") or 0,
            "trust_remote_code": entry.get("trust_remote_code") or False}
    spec |= {k: entry[k] for k in ("data_files", "ds_type") if entry.get(k) is not None}
    d["datasets"], d["streaming"] = [spec], True
    return out


def _streaming_rules(d: dict) -> list[str]:
    """Axolotl's rules for streamed data (its PretrainingValidationMixin), and what a stream cannot give."""
    what = "pretraining_dataset" if d.get("pretraining_dataset") else "streaming: true"
    out = []
    if not d.get("max_steps"):
        out.append(f"{what} without max_steps: a stream has no length, so the run's steps and LR schedule need "
                   "max_steps (Axolotl refuses it too); set max_steps")
    if d.get("val_set_size"):
        out.append(f"val_set_size with {what}: held-out samples of a stream are not kept (Axolotl refuses it too and "
                   "names test_datasets, which a stream does not take here either); drop val_set_size")
    if d.get("dataset_exact_deduplication"):
        out.append(f"dataset_exact_deduplication with {what}: a stream is not deduplicated (Axolotl refuses it too); "
                   "drop one of them")
    if d.get("rl"):
        out.append(f"rl={d['rl']!r} with {what}: preference pairs are read from local files; drop streaming")
    entries = d.get("datasets")
    if isinstance(entries, list) and len(entries) > 1:
        out.append(f"{what} with {len(entries)} datasets entries: one entry is streamed (Axolotl's limit with "
                   "sample_packing); keep one, or drop streaming to mix local files")
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        split = entry.get("split") if isinstance(entry, dict) else None
        if isinstance(split, str) and "[" in split:
            out.append(f"datasets[{i}].split={split!r}: a slice needs the row count, which a stream does not have; "
                       "use the split's name (with skip: N to leave out its first records)")
        skip = entry.get("skip") if isinstance(entry, dict) else None
        if skip is not None and (isinstance(skip, bool) or not isinstance(skip, int) or skip < 0):
            out.append(f"datasets[{i}].skip={skip!r}; write a number of records >= 0")
    return out


def streaming_notes(d: dict) -> list[str]:
    """One line per key read other than as written."""
    notes = data_options.notes(d)
    if (d.get("streaming") or d.get("pretraining_dataset")) and d.get("num_epochs") not in (None, 1):
        notes.append(f"num_epochs={d['num_epochs']}: a stream runs for max_steps (as in Axolotl)")
    if d.get("reinit_weights"):
        notes.append("reinit_weights: the model starts from its config's own random init (seed "
                     f"{d.get('seed', 42)}); the checkpoint's weights are not read")
    return notes
