"""Data for `nd-parallel train`, built with `datasets` in the parent process before any rank starts.

    prepared = prepare(cfg, workdir)   # tokenizer + tokenized (and packed) train/eval splits, saved to disk
    train, eval_, tokenizer = load_prepared(prepared.path)   # what every rank does
    samples, how = build_samples(model_dir, [DatasetSpec(path)], 64)   # tensors, for an Accelerate loop

Streamed data (`streaming: true`, `pretraining_dataset`) takes streamed.py's path instead.

Order (Axolotl's): read each `datasets:` entry -> tokenize it with `map` (formats.py) -> drop samples longer than
sequence_len -> merge and shuffle -> drop exact duplicates (dataset_exact_deduplication) -> hold out val_set_size
-> pack (packing.py). The result is saved under
`dataset_prepared_path/<fingerprint>` and reused while the data files, tokenizer and settings stay the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nd_parallel.config import ConfigError

from . import mistral
from .collate import Collator, collate
from .dpo_types import TYPES as DPO_TYPES
from .dpo_types import dpo_fn
from .formats import chunk_fn, tokenize_fn
from .kto import kto_fn
from .orpo import TYPES as ORPO_TYPES
from .orpo import argilla_fn
from .packing import pack_fn
from .preference import preference_fn
from .reward import reward_fn
from .sources import REWARD_TYPES, DatasetSpec, load_source
from .tokenizer import check_sequence_len, load_tokenizer

__all__ = ["Collator", "DatasetSpec", "Prepared", "build_samples", "collate", "load_prepared", "prepare"]


@dataclass
class Prepared:
    path: str
    """Directory with train/, eval/ (if val_set_size) and tokenizer/."""
    tokenizer_how: str
    sources: list[str] = field(default_factory=list)
    """One line per datasets entry: file, records, samples kept."""
    train_rows: int = 0
    eval_rows: int = 0
    cached: bool = False


def _fingerprint(cfg, tokenizer) -> str:
    """Changes when anything that shapes the tokenized data changes (files by size and mtime)."""
    stats = []
    for spec in [*cfg.datasets, *(cfg.test_datasets or [])]:
        root = spec.resolved
        files = sorted(root.rglob("*")) if root.is_dir() else [root]
        stats += [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    keys = ("sequence_len", "sample_packing", "eval_sample_packing", "train_on_inputs", "val_set_size", "seed",
            "shuffle_merged_datasets", "eot_tokens", "min_sample_len", "dataset_exact_deduplication", "rl",
            "excess_length_strategy", "dataset_shard_num", "dataset_shard_idx", "chat_template_kwargs", "use_pose",
            "pose_max_context_len", "pose_split_on_token_ids", "pose_num_chunks")
    state = {"specs": [asdict(s) for s in cfg.datasets], "files": stats, "cfg": {k: getattr(cfg, k) for k in keys},
             "test": [asdict(s) for s in cfg.test_datasets or []], "eval_sequence_len": cfg.eval_sequence_len}
    from ..grpo import RL, is_transform, module_file

    if cfg.rl in RL:  # rl: grpo's transforms are the user's code: an edit makes other prompts
        files = [module_file(s.type, cfg.import_dirs) for s in cfg.datasets if is_transform(s.type)]
        state["code"] = [Path(f).read_text() for f in files if f]
    if mistral.is_mistral(tokenizer):  # its file is the whole tokenizer (no template, no added tokens)
        state["tokenizer"] = "mistral-common " + mistral.fingerprint(tokenizer)
    else:
        state |= {"tokenizer": tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else repr(tokenizer),
                  "template": tokenizer.chat_template,
                  "added": {str(k): v for k, v in tokenizer.get_added_vocab().items()}}
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tokenized(spec: DatasetSpec, tokenizer, cfg, cache: str):
    raw, where = load_source(spec, cache)
    if spec.type == "chat_template" and mistral.is_mistral(tokenizer):  # mistral-common renders the conversation
        fn = mistral.chat_fn(spec, tokenizer, where, train_on_inputs=cfg.train_on_inputs)
    elif spec.type in REWARD_TYPES:  # reward_model / process_reward_model (reward.py)
        fn = reward_fn(spec, tokenizer, where, cfg.sequence_len)
    else:
        fn = tokenize_fn(spec, tokenizer, where, sequence_len=cfg.sequence_len, train_on_inputs=cfg.train_on_inputs,
                         eot_tokens=cfg.eot_tokens, template_kwargs=cfg.chat_template_kwargs)
    ds = raw.map(fn, batched=True, with_indices=True, remove_columns=raw.column_names,
                 desc=f"tokenizing {spec.path}")
    if spec.type == "pretraining":
        ds = ds.map(chunk_fn(cfg.sequence_len), batched=True, desc="cutting into sequence_len blocks")
    if spec.type == "bradley_terry.chat_template":  # pairs, cut to sequence_len: Axolotl drops none of them
        return ds, f"{where}: {len(raw)} records -> {len(ds)} pairs ({spec.type})"
    from ..data_options import length_filter

    shortest = cfg.min_sample_len or 2  # Axolotl's min_sample_len (default 2)
    kept = length_filter(ds, cfg, where)  # excess_length_strategy: drop, truncate or raise
    kept = kept.filter(lambda row: any(t != -100 for t in row["labels"]), desc="dropping untrained samples")
    if len(kept) == 0:
        raise ConfigError(f"{where}: none of its {len(raw)} records is left after tokenizing and filtering (samples "
                          f"must have {shortest} (min_sample_len) to sequence_len={cfg.sequence_len} tokens and at "
                          "least one trained token); raise sequence_len, lower min_sample_len, check 'type:' / the "
                          "field names, or remove this entry")
    return kept, f"{where}: {len(raw)} records -> {len(kept)} samples ({spec.type})"


def _pairs(spec: DatasetSpec, tokenizer, cfg, cache: str):
    """rl: the entry's records as prompt / chosen / rejected strings (dpo, ipo: preference.py; orpo: orpo.py) or
    prompt / completion / label (kto: kto.py); TRL's trainer tokenizes them."""
    raw, where = load_source(spec, cache)
    fn, what = (kto_fn(spec, where), "KTO examples") if cfg.rl == "kto" else (
        dpo_fn(spec, where) if spec.type in DPO_TYPES else argilla_fn(tokenizer, where) if spec.type in ORPO_TYPES
        else preference_fn(spec, tokenizer, where), "preference pairs")
    ds = raw.map(fn, batched=True, with_indices=True, remove_columns=raw.column_names,
                 desc=f"rendering {what} of {spec.path}")
    return ds, f"{where}: {len(raw)} records -> {len(ds)} {what}"


def _deduplicated(ds):
    """(ds without the samples equal to an earlier one, how many were dropped): Axolotl's exact deduplication
    hashes each tokenized row; here a row is its input_ids and labels (nothing else is stored before packing)."""
    seen, keep = set(), []
    for i, row in enumerate(zip(*(ds[c] for c in ds.column_names))):  # rl: dpo's rows are its three strings
        key = hashlib.sha256(json.dumps(row).encode()).digest()
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return (ds if len(keep) == len(ds) else ds.select(keep)), len(ds) - len(keep)


def _split(ds, cfg):
    if not cfg.val_set_size:
        return ds, None
    size = cfg.val_set_size if cfg.val_set_size < 1 else int(cfg.val_set_size)
    if (size if size >= 1 else round(size * len(ds))) >= len(ds) or (size < 1 and round(size * len(ds)) == 0):
        raise ConfigError(f"val_set_size={cfg.val_set_size} leaves no training or no evaluation samples out of "
                          f"{len(ds)}; use a share between {1 / len(ds):.3g} and {1 - 1 / len(ds):.3g} or a count")
    split = ds.train_test_split(test_size=size, shuffle=False, seed=cfg.seed)
    return split["train"], split["test"]


def _merged(specs, cfg, tokenizer, workdir, lines: list[str], name: str = "datasets"):
    """The entries' samples (or pairs / prompts under rl) tokenized, concatenated, shuffled when several
    (shuffle_merged_datasets) and deduplicated (dataset_exact_deduplication); one line per entry into `lines`."""
    import datasets

    from ..grpo import RL, prompts

    parts = []
    for i, spec in enumerate(specs):
        if cfg.rl in RL:  # prompts, made by the entry's transform (grpo.py); TRL tokenizes them
            raw, where = load_source(spec, str(Path(workdir) / "raw-cache"))
            ds, line = prompts(raw, spec, i, cfg, tokenizer, where)
        else:
            ds, line = (_pairs if cfg.rl else _tokenized)(spec, tokenizer, cfg, str(Path(workdir) / "raw-cache"))
        parts.append(ds)
        lines.append(line if name == "datasets" else f"{name}: {line}")
    # one schema for all (pre-tokenized records come in as int64, the tokenizer's ids as int32)
    parts = [parts[0], *(p.cast(parts[0].features) for p in parts[1:])]
    merged = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if cfg.shuffle_merged_datasets and len(parts) > 1:
        merged = merged.shuffle(seed=cfg.seed)
    if cfg.dataset_exact_deduplication:
        merged, dropped = _deduplicated(merged)
        where = "" if name == "datasets" else f" ({name})"
        lines.append(f"dataset_exact_deduplication{where}: {dropped} duplicate sample(s) dropped, {len(merged)} kept")
    return merged


def prepare(cfg, workdir: str | os.PathLike, dp: int = 1) -> Prepared:
    """Tokenize, filter, mix, split and pack the YAML's data; see the module docstring. A streamed run
    (streaming.py) reads only the rows of its max_steps global batches over `dp` data-parallel ranks."""
    import datasets

    datasets.disable_progress_bars()
    if cfg.processor_type:  # vision-language rows: normalised here, processed by each rank (mm_rows.py)
        from .mm_rows import prepare_multimodal

        return Prepared(*prepare_multimodal(cfg, workdir, _split, dp))
    tokenizer, how = load_tokenizer(cfg)
    check_sequence_len(cfg)
    if cfg.streaming:  # never cached: a stream (a hub dataset) is read again every run, as in Axolotl
        from .streamed import prepare_streamed

        path, lines, rows = prepare_streamed(cfg, tokenizer, Path(workdir), dp)
        return Prepared(path, how, lines, rows, 0)
    key = _fingerprint(cfg, tokenizer)
    root = Path(cfg.dataset_prepared_path) if cfg.dataset_prepared_path else Path(workdir) / "prepared"
    out = root / key
    if (out / "done.json").is_file():
        info = json.loads((out / "done.json").read_text())
        return Prepared(str(out), how, info["sources"], info["train_rows"], info["eval_rows"], cached=True)
    lines: list[str] = []
    merged = _merged(cfg.datasets, cfg, tokenizer, workdir, lines)
    from ..data_options import shard

    merged, line = shard(merged, cfg)  # dataset_shard_num / dataset_shard_idx, before the split as in Axolotl
    lines += [line] if line else []
    train, evals = _split(merged, cfg)
    if cfg.test_datasets:  # Axolotl's test_datasets: the evaluation data (val_set_size is 0), prepared alike
        test_cfg = dataclasses.replace(cfg, sequence_len=cfg.eval_sequence_len or cfg.sequence_len)
        evals = _merged(cfg.test_datasets, test_cfg, tokenizer, workdir, lines, "test_datasets")
    from ..pose import apply as pose

    train, evals = pose(train, evals, cfg)  # use_pose: position ids with random skips (PoSE)
    eval_packing = cfg.sample_packing if cfg.eval_sample_packing is None else cfg.eval_sample_packing
    if cfg.sample_packing:
        train = train.map(pack_fn(cfg.sequence_len), batched=True, batch_size=1000, desc="packing")
    if evals is not None and eval_packing:
        evals = evals.map(pack_fn(cfg.sequence_len), batched=True, batch_size=1000, desc="packing eval")
    train.save_to_disk(str(out / "train"))
    if evals is not None:
        evals.save_to_disk(str(out / "eval"))
    tokenizer.save_pretrained(str(out / "tokenizer"))
    info = {"sources": lines, "train_rows": len(train), "eval_rows": len(evals) if evals is not None else 0}
    (out / "done.json").write_text(json.dumps(info))  # last: a half-written folder is never reused
    return Prepared(str(out), how, lines, info["train_rows"], info["eval_rows"])


def load_prepared(path: str):
    """(train, eval or None, tokenizer) saved by `prepare`: what each rank reads."""
    import datasets
    from transformers import AutoTokenizer

    root = Path(path)
    train = datasets.load_from_disk(str(root / "train"))
    evals = datasets.load_from_disk(str(root / "eval")) if (root / "eval").is_dir() else None
    if mistral.saved(root / "tokenizer"):
        return train, evals, mistral.load_tokenizer(root / "tokenizer")[0]
    return train, evals, AutoTokenizer.from_pretrained(str(root / "tokenizer"), mistral_format=False)


def build_samples(base_model: str, paths: list, sequence_len: int) -> tuple[list[dict], str]:
    """(samples, how the tokenizer was found): completion samples of local text files, packed and padded to
    sequence_len, as tensors (examples/train.py's Accelerate loop). The same pipeline as `nd-parallel train`;
    `paths`: files or DatasetSpec objects."""
    import tempfile

    from ..config import TrainConfig  # not at the top: config.py imports this package

    specs = [p if isinstance(p, DatasetSpec) else DatasetSpec(path=os.path.abspath(str(p))) for p in paths]
    cfg = TrainConfig(base_model=base_model, datasets=specs, sequence_len=sequence_len, sample_packing=True)
    with tempfile.TemporaryDirectory(prefix="nd-parallel-samples-") as tmp:
        prepared = prepare(cfg, tmp)
        rows, _, tokenizer = load_prepared(prepared.path)
        collator = Collator(tokenizer.pad_token_id, pad_to=sequence_len)
        return [{k: v[0] for k, v in collator([row]).items()} for row in rows], prepared.tokenizer_how
