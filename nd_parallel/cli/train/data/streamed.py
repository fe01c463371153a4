"""Streamed data (``streaming: true``, ``pretraining_dataset``): read, tokenized and packed only as far as the run
needs, in the parent before any rank starts (the config side and the rules: cli/train/streaming.py).

    records --skip--> shuffle buffer --chunks of streaming_multipack_buffer_size records--> tokenize -> filter
            -> pack (sequence_len rows) --the first `rows` rows--> train/ (save_to_disk, as prepare() writes it)

Tokenizing, Axolotl's meanings: a `pretraining` text (pretraining_dataset's `type: pretrain`) is cut into windows of
sequence_len - 1 tokens overlapping by min(256, (sequence_len - 1) // 2), each + EOS (its PretrainTokenizationStrategy)
when packed; unpacked, each text is cut to sequence_len - 2 tokens (its encode_streaming), with no EOS unless
``pretraining_sample_concatenation: true`` (then + EOS; Axolotl also appends one PAD token, label -100 and masked out,
which is not written here). Every other type is
tokenized as for local files (formats.py). Packing is packing.py's (whole samples, per-document position ids), per
chunk; ``pretrain_multipack_attn: false`` and ``pretraining_sample_concatenation`` pack without them (the documents
of a row attend to each other). Where Axolotl packs micro_batch_size x sequence_len tokens into one row and sets
micro_batch_size to 1, here micro_batch_size rows of sequence_len tokens make the same tokens per step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from nd_parallel.config import ConfigError

from . import mistral
from .formats import _field, _records, tokenize_fn
from .packing import pack_fn
from .sources import open_stream


def rows_needed(cfg, dp: int) -> int:
    """Rows of one run: max_steps global batches of micro_batch_size x gradient_accumulation_steps x dp rows."""
    return cfg.max_steps * cfg.micro_batch_size * cfg.gradient_accumulation_steps * dp


def _pretraining_fn(spec, tokenizer, where: str, cfg):
    """Axolotl's pretraining tokenization of a batch of records (see the module docstring)."""
    L, eos, packed = cfg.sequence_len, tokenizer.eos_token_id, cfg.sample_packing
    with_eos = eos is not None and (packed or cfg.pretraining_sample_concatenation is True)
    fix = f"set pretraining_dataset's 'text_column:' to the column holding the text (now {spec.text_field!r})"

    def fn(batch, indices):
        texts = [str(_field(rec, spec.text_field, where, i, fix)) for i, rec in zip(indices, _records(batch))]
        if packed:
            enc = tokenizer(texts, truncation=True, max_length=L - 1, add_special_tokens=True,
                            return_overflowing_tokens=True, stride=min(256, (L - 1) // 2))
        else:
            enc = tokenizer(texts, truncation=True, max_length=L - 2, add_special_tokens=True)
        ids = [list(seq) + ([eos] if with_eos else []) for seq in enc["input_ids"]]
        return {"input_ids": ids, "labels": [list(seq) for seq in ids]}

    return fn


def _record_fn(spec, tokenizer, where: str, cfg):
    if spec.type == "pretraining":
        return _pretraining_fn(spec, tokenizer, where, cfg)
    if spec.type == "chat_template" and mistral.is_mistral(tokenizer):
        return mistral.chat_fn(spec, tokenizer, where, train_on_inputs=cfg.train_on_inputs)
    return tokenize_fn(spec, tokenizer, where, sequence_len=cfg.sequence_len, train_on_inputs=cfg.train_on_inputs,
                       eot_tokens=cfg.eot_tokens, template_kwargs=cfg.chat_template_kwargs)


def _rows(stream, fn, cfg, wanted: int, count: dict):
    """Yield packed (or single-sample) rows until `wanted` are made or the stream ends; count what was read."""
    shortest, chunk = cfg.min_sample_len or 2, cfg.streaming_multipack_buffer_size
    cross = cfg.pretraining_dataset and not (cfg.pretrain_multipack_attn if cfg.sample_packing
                                             else not cfg.pretraining_sample_concatenation)
    pack = pack_fn(cfg.sequence_len) if cfg.sample_packing or cross else None
    for batch in stream.iter(batch_size=chunk):
        n = len(next(iter(batch.values())))
        out = fn(batch, range(count["records"], count["records"] + n))
        count["records"] += n
        keep = [(ids, labels) for ids, labels in zip(out["input_ids"], out["labels"])
                if shortest <= len(ids) <= cfg.sequence_len and any(t != -100 for t in labels)]
        count["samples"] += len(keep)
        rows = {"input_ids": [k[0] for k in keep], "labels": [k[1] for k in keep]}
        if pack is not None and keep:
            rows = pack(rows)
            if cross:  # no position ids: the collator's attention mask lets the row's documents see each other
                rows.pop("position_ids")
        for values in zip(*rows.values()):
            yield dict(zip(rows, values))
            count["rows"] += 1
            if count["rows"] == wanted:
                return
    count["ended"] = True  # the stream ran out (with no row at all, datasets then refuses to write: said as such)


def prepare_streamed(cfg, tokenizer, workdir: Path, dp: int) -> tuple[str, list[str], int]:
    """(directory with train/ and tokenizer/, one line of what was read, rows) for a streaming run."""
    import datasets

    spec = cfg.datasets[0]
    stream, where = open_stream(spec)
    if spec.skip:
        stream = stream.skip(spec.skip)
    if cfg.shuffle_merged_datasets:  # Axolotl shuffles the stream in a buffer of this many records
        stream = stream.shuffle(seed=cfg.seed, buffer_size=cfg.streaming_multipack_buffer_size)
    wanted, count = rows_needed(cfg, dp), {"records": 0, "samples": 0, "rows": 0}
    fn = _record_fn(spec, tokenizer, where, cfg)
    workdir.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="streamed-", dir=str(workdir))  # a fresh cache: the stream is read every run
    train = None
    try:
        train = datasets.Dataset.from_generator(_rows, cache_dir=cache, gen_kwargs={
            "stream": stream, "fn": fn, "cfg": cfg, "wanted": wanted, "count": count})
    except datasets.exceptions.DatasetGenerationError as err:  # a bad record: its ConfigError, named
        cause = err.__cause__ or err.__context__ or err
        if isinstance(cause, ConfigError):
            raise cause from None
        if not (count.get("ended") and count["rows"] == 0):
            raise ConfigError(f"{where}: reading the stream failed after {count['records']} records: "
                              f"{type(cause).__name__}: {cause}") from cause  # a network or tokenizer error
    if count["rows"] == 0:
        raise ConfigError(f"{where}: none of the {count['records']} records read is left after tokenizing and "
                          f"filtering (samples of {cfg.min_sample_len or 2} to sequence_len={cfg.sequence_len} tokens "
                          "with a trained token); check 'type:' / the text column, or raise sequence_len")
    out = workdir / "streamed"
    train.save_to_disk(str(out / "train"))
    tokenizer.save_pretrained(str(out / "tokenizer"))
    ended = "" if count["rows"] == wanted else (f"; the stream ended before the {wanted} rows max_steps needs: "
                                                "the Trainer passes over these again")
    line = (f"{where}: {count['records']} records read -> {count['samples']} samples -> {count['rows']} rows "
            f"({spec.type}, streamed{', packed' if cfg.sample_packing else ''}){ended}")
    return str(out), [line], count["rows"]
