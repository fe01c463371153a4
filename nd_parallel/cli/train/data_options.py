"""Axolotl's keys that choose which tokenized samples a run trains on, with its meaning (its utils/data):

- ``excess_length_strategy``: a sample longer than ``sequence_len`` is dropped (``drop``, the default), cut to
  ``sequence_len`` (``truncate``: input ids, labels, attention mask and position ids), or stops the run (``raise``:
  here in the parent, naming the count and the fix); samples shorter than ``min_sample_len`` are dropped either way;
- ``dataset_shard_num`` / ``dataset_shard_idx``: after the datasets are merged (shuffled, deduplicated), only shard
  ``idx`` of ``num`` (``datasets.Dataset.shard``: contiguous blocks) is kept, before the evaluation split.
- ``pad_to_multiple_of``: supervised batches are padded to a multiple of it (their longest row rounded up; with
  ``pad_to_sequence_len`` or packing, ``sequence_len`` rounded up), as Axolotl's collator pads them. Padding is
  masked, so the loss is the same; only what reads the padded length (NEFTune's scale) sees it;
- ``test_datasets``: entries like ``datasets:``'s, prepared the same way (tokenized, filtered, merged,
  deduplicated, packed when evaluation packs) as the evaluation data, with ``val_set_size`` 0 (Axolotl's rule);
  ``eval_sequence_len`` replaces ``sequence_len`` for them (Axolotl applies it to test_datasets only);
- ``batch_flattening`` (true or auto): each supervised micro-batch is one row, its samples back to back with their
  own position ids (the first label of each masked), as transformers' DataCollatorWithFlattening lays them; the
  attention stays inside each sample (as for packed rows), so the loss is the padded batch's, without padding;
- ``chat_template_kwargs``: extra variables for the chat template of ``type: chat_template`` datasets (e.g.
  ``enable_thinking: false``), passed to ``apply_chat_template`` as Axolotl's ChatTemplatePrompter passes them.

``excess_length_strategy`` and ``dataset_shard_*`` apply to supervised data: with ``rl`` (TRL's trainers read the
pairs / prompts) and with streamed data they are refused; ``test_datasets`` with GRPO, streams or a processor too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STRATEGIES = ("drop", "truncate", "raise")
# apply_chat_template's own arguments, which the tokenization sets
RESERVED = {"conversation", "messages", "tokenize", "add_generation_prompt", "chat_template", "return_dict",
            "continue_final_message"}


@dataclass(kw_only=True)
class DataOptions:
    excess_length_strategy: str | None = None
    """Samples longer than sequence_len: drop (default), truncate (cut to sequence_len) or raise (stop the run)."""
    dataset_shard_num: int | None = None
    """Keep one of this many contiguous shards of the merged data (with dataset_shard_idx)."""
    dataset_shard_idx: int | None = None
    """Which shard dataset_shard_num keeps (0-based)."""
    test_datasets: list | None = None
    """Evaluation data given as datasets: entries (prepared like the training data); val_set_size must be 0."""
    eval_sequence_len: int | None = None
    """The sequence length test_datasets' samples are filtered by (instead of sequence_len), Axolotl's meaning."""
    pad_to_multiple_of: int | None = None
    """Pad each supervised batch to a multiple of this many tokens (sequence_len rounded up with
    pad_to_sequence_len or packing), as Axolotl's collator does."""
    added_tokens_overrides: dict | None = None
    """Token id -> new string for the tokenizer's added tokens (e.g. reserved special tokens), Axolotl's meaning."""
    batch_flattening: bool | str | None = None
    """true / auto: each supervised micro-batch laid out as one row of its samples (no padding), the same loss."""
    chat_template_kwargs: dict | None = None
    """Variables for the chat template of chat_template datasets (e.g. enable_thinking: false), as Axolotl passes
    them to apply_chat_template."""


def refusals(d: dict) -> list[str]:
    out = []
    strategy = d.get("excess_length_strategy")
    if isinstance(strategy, str):
        d["excess_length_strategy"] = strategy = strategy.lower()  # Axolotl lower-cases it
    if strategy is not None and strategy not in STRATEGIES:
        out.append(f"excess_length_strategy={strategy!r}; use one of {', '.join(STRATEGIES)}")
    num, idx = d.get("dataset_shard_num"), d.get("dataset_shard_idx")
    if num is not None or idx is not None:
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (num, idx))
        if not ints or num < 1 or not 0 <= idx < num:
            out.append(f"dataset_shard_num={num!r}, dataset_shard_idx={idx!r}: write both, an index in "
                       "[0, dataset_shard_num)")
    out += _test_datasets(d) + _flattening(d)
    renames = d.get("added_tokens_overrides")
    if renames is not None and not (isinstance(renames, dict) and all(
            str(k).lstrip("-").isdigit() and isinstance(v, str) and v for k, v in renames.items())):
        out.append(f"added_tokens_overrides={renames!r}: write a mapping of token ids to new strings, e.g. "
                   "{128011: '<|im_start|>'}")
    elif renames and d.get("tokenizer_use_mistral_common"):
        out.append("added_tokens_overrides with tokenizer_use_mistral_common: mistral-common's tokenizer file is not "
                   "rewritten here; drop one of them")
    multiple = d.get("pad_to_multiple_of")
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
        out.append(f"pad_to_multiple_of={multiple!r}: write an integer >= 1 (tokens)")
    kwargs = d.get("chat_template_kwargs")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        out.append(f"chat_template_kwargs={kwargs!r}: write a mapping of template variables, e.g. "
                   "{enable_thinking: false}")
    elif kwargs and set(kwargs) & RESERVED:
        out.append(f"chat_template_kwargs sets {', '.join(sorted(set(kwargs) & RESERVED))}: the rendering itself "
                   "sets these (the conversation, tokenize, the generation prompt); drop them")
    elif kwargs and (d.get("processor_type") or d.get("tokenizer_use_mistral_common")):
        key = "processor_type" if d.get("processor_type") else "tokenizer_use_mistral_common"
        out.append(f"chat_template_kwargs with {key}: the processor's / mistral-common's rendering does not take "
                   "template variables here; drop chat_template_kwargs")
    used = [k for k in ("dataset_shard_num",) if d.get(k) is not None] + (
        ["excess_length_strategy"] if strategy not in (None, "drop") else [])
    for why, on in (("rl", d.get("rl")), ("streamed data", d.get("streaming") or d.get("pretraining_dataset"))):
        out += [f"{k} with {why}: it applies to the supervised samples prepared before training; drop it"
                for k in used if on]
    return out


def length_filter(ds, cfg, where: str):
    """The tokenized samples kept by excess_length_strategy and min_sample_len (see the module docstring)."""
    from nd_parallel.config import ConfigError

    shortest, longest = cfg.min_sample_len or 2, cfg.sequence_len  # Axolotl's min_sample_len (default 2)
    strategy = cfg.excess_length_strategy or "drop"
    if strategy == "raise":
        over = sum(1 for ids in ds["input_ids"] if len(ids) > longest)
        if over:
            raise ConfigError(f"{where}: {over} sample(s) are longer than sequence_len={longest} "
                              "(excess_length_strategy: raise); raise sequence_len, or set excess_length_strategy: "
                              "drop or truncate")
    if strategy == "truncate":
        ds = ds.filter(lambda row: len(row["input_ids"]) >= shortest, desc="dropping short samples")
        columns = [c for c in ("input_ids", "labels", "attention_mask", "position_ids") if c in ds.column_names]
        return ds.map(lambda row: {c: row[c][:longest] for c in columns}, desc="truncating long samples")
    return ds.filter(lambda row: shortest <= len(row["input_ids"]) <= longest, desc="dropping long and short samples")


def shard(ds, cfg):
    """dataset_shard_num / dataset_shard_idx: the kept shard, and a line for the sources, or (ds, None)."""
    if not cfg.dataset_shard_num:
        return ds, None
    kept = ds.shard(num_shards=cfg.dataset_shard_num, index=cfg.dataset_shard_idx, contiguous=True)
    return kept, (f"dataset_shard_num={cfg.dataset_shard_num}, dataset_shard_idx={cfg.dataset_shard_idx}: "
                  f"{len(kept)} of {len(ds)} samples kept")


def _flattening(d: dict) -> list[str]:
    """Axolotl's rules (not with sample_packing, unless auto, which packing then overrides); PP splits a micro-batch
    into rows, which one flattened row cannot be."""
    value = d.get("batch_flattening")
    if value in (None, False):
        return []
    if value not in (True, "auto"):
        return [f"batch_flattening={value!r}: write true, false or auto"]
    if value is True and d.get("sample_packing"):
        return ["batch_flattening with sample_packing (Axolotl refuses it too): packed rows have no padding already; "
                "drop one of them"]
    if (d.get("pipeline_parallel_size") or 1) > 1 and not d.get("sample_packing"):
        return [f"batch_flattening with pipeline_parallel_size={d['pipeline_parallel_size']}: the pipeline splits a "
                "micro-batch into rows, and a flattened micro-batch is one row; drop batch_flattening"]
    return []


def flattens(t) -> bool:
    """Whether the supervised collator flattens (batch_flattening true / auto, no packing)."""
    return t.batch_flattening in (True, "auto") and not t.sample_packing


def _test_datasets(d: dict) -> list[str]:
    out, tests, longest = [], d.get("test_datasets"), d.get("eval_sequence_len")
    if longest is not None and (isinstance(longest, bool) or not isinstance(longest, int) or longest < 1):
        out.append(f"eval_sequence_len={longest!r}: write an integer >= 1 (tokens)")
    if not tests:
        return out
    if d.get("val_set_size"):
        out.append(f"test_datasets with val_set_size={d['val_set_size']}: the evaluation data is one or the other "
                   "(Axolotl's rule); set val_set_size: 0 or drop test_datasets")
    from .grpo import RL

    other = ("processor_type" if d.get("processor_type") else "streamed data" if d.get("streaming") or d.get(
        "pretraining_dataset") else f"rl: {d['rl']}" if d.get("rl") in RL else None)
    if other:
        out.append(f"test_datasets with {other}: its evaluation data is not prepared from test_datasets here; drop "
                   "test_datasets (or use val_set_size where it is accepted)")
    return out


def notes(d: dict) -> list[str]:
    """chat_template_kwargs under rl: Axolotl 0.19 reads it in its supervised chat_template strategy only.
    pad_to_multiple_of where TRL's or a processor's collator pads the batches."""
    out = []
    if d.get("eval_sequence_len") and not d.get("test_datasets"):
        out.append("eval_sequence_len without test_datasets: Axolotl 0.19 applies it to test_datasets only; the "
                   "val_set_size split is filtered by sequence_len there and here")
    if d.get("chat_template_kwargs") and d.get("rl"):
        out.append(f"chat_template_kwargs with rl: {d['rl']}: Axolotl 0.19 passes it to the supervised chat_template "
                   "datasets only, so it changes nothing here either (GRPO's template variables: "
                   "trl.chat_template_kwargs)")
    other = d.get("rl") or d.get("processor_type") or d.get("reward_model") or d.get("process_reward_model")
    for key in ("pad_to_multiple_of", "batch_flattening"):
        if d.get(key) and other:
            out.append(f"{key}: these batches are laid out by TRL's / the processor's collator here, padded to their "
                       "longest row; padding is masked, so the loss is the same")
    return out


def padding(t) -> tuple[int | None, int | None]:
    """(the length every batch is padded to, or None; the multiple a batch's longest row is rounded up to)."""
    multiple = t.pad_to_multiple_of
    pad_to = t.sequence_len if t.pad_to_sequence_len or t.sample_packing else None
    if pad_to and multiple:
        pad_to = multiple * math.ceil(pad_to / multiple)
    return pad_to, multiple


def collator(t, pad_id: int):
    """The supervised batches' collator for TrainConfig `t`: its padding (``padding``) or batch_flattening."""
    from .data.collate import Collator

    pad_to, multiple = padding(t)
    return Collator(pad_id, pad_to, multiple, flatten=flattens(t))
