"""Record -> (input_ids, labels) for each dataset `type`, with Axolotl's meanings; used with `Dataset.map`.

- completion: the whole text is trained on; cut to sequence_len.
- alpaca: Axolotl's Alpaca prompt; only the response (and EOS) is trained on unless train_on_inputs.
- chat_template: the tokenizer's chat template renders the conversation; only the turns of roles_to_train
  (assistant by default) are trained on, their end-of-turn tokens included (train_on_eos: turn).
- pretraining: texts joined with EOS and cut into sequence_len blocks, every token trained on.

A bad record raises ConfigError naming the file, the record and the fix (map runs in the parent, before any rank).
"""

from __future__ import annotations

from nd_parallel.config import ConfigError
from nd_parallel.distributed.loss import IGNORE_INDEX

from .sources import DatasetSpec

ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def _field(record: dict, key: str, where: str, i: int, fix: str):
    value = record.get(key)
    if value is None:
        have = ", ".join(k for k, v in record.items() if v is not None) or "nothing"
        raise ConfigError(f"{where}, record {i}: no {key!r} field (it has {have}); {fix}")
    return value


def _records(batch: dict):
    keys = list(batch)
    return [dict(zip(keys, values)) for values in zip(*(batch[k] for k in keys))]


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and ids[-1:] != [eos] else ids


def tokenize_fn(spec: DatasetSpec, tokenizer, where: str, *, sequence_len: int, train_on_inputs: bool):
    """A batched `map` function (with_indices=True) for `spec.type`."""
    if spec.type in ("completion", "pretraining"):
        fix = f"set 'field:' to the column holding the text (now {spec.text_field!r})"

        def text(batch, indices):
            out = {"input_ids": [], "labels": []}
            for i, rec in zip(indices, _records(batch)):
                value = _field(rec, spec.text_field, where, i, fix)
                ids = _with_eos(tokenizer(str(value))["input_ids"], tokenizer)
                if spec.type == "completion":
                    ids = ids[:sequence_len]  # Axolotl cuts long completion texts rather than dropping them
                out["input_ids"].append(ids)
                out["labels"].append(list(ids))
            return out

        return text
    if spec.type == "alpaca":
        return lambda batch, indices: _alpaca(batch, indices, tokenizer, where, train_on_inputs)
    return lambda batch, indices: _chat(batch, indices, spec, tokenizer, where, train_on_inputs)


def _alpaca(batch, indices, tokenizer, where: str, train_on_inputs: bool) -> dict:
    out = {"input_ids": [], "labels": []}
    fix = "alpaca records need instruction, output and optionally input; fix the record or pick another type"
    for i, rec in zip(indices, _records(batch)):
        instruction = _field(rec, "instruction", where, i, fix)
        response = _field(rec, "output", where, i, fix)
        extra = rec.get("input") or ""
        prompt = (ALPACA if extra else ALPACA_NO_INPUT).format(instruction=instruction, input=extra)
        prompt_ids = tokenizer(prompt)["input_ids"]
        answer = _with_eos(tokenizer(str(response), add_special_tokens=False)["input_ids"], tokenizer)
        out["input_ids"].append(prompt_ids + answer)
        out["labels"].append((prompt_ids if train_on_inputs else [IGNORE_INDEX] * len(prompt_ids)) + answer)
    return out


def _turns(rec: dict, spec: DatasetSpec, where: str, i: int) -> list[dict]:
    turns = _field(rec, spec.field_messages, where, i, f"set field_messages to the column holding the turns "
                   f"(now {spec.field_messages!r})")
    roles = spec.role_map
    out = []
    for t, turn in enumerate(turns):
        role = turn.get(spec.role_key) if isinstance(turn, dict) else None
        content = turn.get(spec.content_key) if isinstance(turn, dict) else None
        if role is None or content is None:
            raise ConfigError(f"{where}, record {i}, turn {t}: needs keys {spec.role_key!r} and "
                              f"{spec.content_key!r} (got {turn!r}); set message_property_mappings: "
                              "{role: KEY, content: KEY} to the dataset's keys")
        if role not in roles:
            raise ConfigError(f"{where}, record {i}, turn {t}: role {role!r} is not one the chat template knows "
                              f"({', '.join(sorted(roles))}); map it in the datasets entry, e.g. roles: "
                              f"{{assistant: [assistant, {role}]}}, or fix the record")
        out.append({"role": roles[role], "content": content})
    return out


def _render(tokenizer, turns: list[dict], generation: bool = False) -> str:
    if not turns and not generation:
        return ""
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation)


def _trained_spans(tokenizer, turns: list[dict], spec: DatasetSpec, full: str) -> list[tuple[int, int]]:
    """Character spans of `full` to train on: each trained turn from after its header to its end-of-turn."""
    spans = []
    for t, turn in enumerate(turns):
        if turn["role"] not in spec.roles_to_train:
            continue
        start = len(_render(tokenizer, turns[:t], generation=turn["role"] == "assistant"))
        end = len(_render(tokenizer, turns[:t + 1]))
        if spec.train_on_eos == "none":  # the content only, without the end-of-turn tokens
            end = full.index(turn["content"], start) + len(turn["content"])
        spans.append((start, end))
    return spans


def _chat(batch, indices, spec: DatasetSpec, tokenizer, where: str, train_on_inputs: bool) -> dict:
    if not tokenizer.chat_template:
        raise ConfigError(f"{where}: type: chat_template, but the tokenizer has no chat template; add one with "
                          "'chat_template: jinja' and 'chat_template_jinja: ...', or use a checkpoint that has one")
    out = {"input_ids": [], "labels": []}
    for i, rec in zip(indices, _records(batch)):
        turns = _turns(rec, spec, where, i)
        try:
            full = _render(tokenizer, turns)
            spans = _trained_spans(tokenizer, turns, spec, full)
        except Exception as err:  # jinja raises its own errors (e.g. roles that must alternate)
            raise ConfigError(f"{where}, record {i}: the chat template refuses this conversation: {err}; fix the "
                              "record or the template") from None
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        labels = [tok if train_on_inputs or any(s <= a and b <= e for s, e in spans) else IGNORE_INDEX
                  for tok, (a, b) in zip(ids, enc["offset_mapping"])]
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def chunk_fn(sequence_len: int):
    """Batched `map` for pretraining: the batch's token streams joined and cut into sequence_len blocks."""

    def chunk(batch):
        ids = [t for row in batch["input_ids"] for t in row]
        blocks = [ids[i:i + sequence_len] for i in range(0, len(ids), sequence_len)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return chunk
