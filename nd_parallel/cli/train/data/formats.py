"""Record -> (input_ids, labels) for each dataset `type`, with Axolotl's meanings; used with `Dataset.map`.

- completion: the whole text is trained on; cut to sequence_len.
- alpaca, alpaca:<style>, alpaca_chat, jeopardy[:<style>]: Axolotl's instruction prompts (instructions.py); only
  the response (and EOS) is trained on unless train_on_inputs.
- chat_template: the chat template (the tokenizer's, or a named one: templates.py) renders the conversation; the
  content of the turns of roles_to_train (assistant by default) is trained on, and the end-of-turn / eos token
  after it per train_on_eos (Axolotl's rules, `_labels`).
- pretraining: texts joined with EOS and cut into sequence_len blocks, every token trained on.
- tokenized (Axolotl's `type:` left empty): records that already hold input_ids and labels, used as they are.

A bad record raises ConfigError naming the file, the record and the fix (map runs in the parent, before any rank).
"""

from __future__ import annotations

from nd_parallel.config import ConfigError
from nd_parallel.distributed.loss import IGNORE_INDEX

from . import instructions
from .sources import DatasetSpec


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


def tokenize_fn(spec: DatasetSpec, tokenizer, where: str, *, sequence_len: int, train_on_inputs: bool,
                eot_tokens: list[str] | None = None, template_kwargs: dict | None = None):
    """A batched `map` function (with_indices=True) for `spec.type`; `template_kwargs` are chat_template_kwargs."""
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
    if spec.type == "tokenized":
        return lambda batch, indices: _pretokenized(batch, indices, where)
    kind = instructions.parse(spec.type)
    if kind is not None:
        return lambda batch, indices: _instruction(batch, indices, kind, tokenizer, where, train_on_inputs)
    kwargs = dict(template_kwargs or {})
    return lambda batch, indices: _chat(batch, indices, spec, tokenizer, where, train_on_inputs, eot_tokens, kwargs)


def _pretokenized(batch, indices, where: str) -> dict:
    """Axolotl's `type:` left empty: records already hold input_ids, labels (and attention_mask), used as they are
    (Axolotl passes such a dataset through untouched; only the length filters apply)."""
    out = {"input_ids": [], "labels": []}
    fix = "pre-tokenized records (type: left empty) need input_ids and labels lists of the same length"
    for i, rec in zip(indices, _records(batch)):
        ids, labels = _field(rec, "input_ids", where, i, fix), _field(rec, "labels", where, i, fix)
        mask = rec.get("attention_mask")
        if not isinstance(ids, list) or not isinstance(labels, list) or len(ids) != len(labels):
            raise ConfigError(f"{where}, record {i}: input_ids and labels must be lists of the same length (got "
                              f"{_length(ids)} and {_length(labels)}); {fix}")
        if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids) or not all(mask)):
            raise ConfigError(f"{where}, record {i}: attention_mask must be all ones over input_ids (padding inside "
                              "a sample is not supported: samples are batched and packed here); strip the padding "
                              "from input_ids, labels and attention_mask")
        out["input_ids"].append([int(t) for t in ids])
        out["labels"].append([int(t) for t in labels])
    return out


def _length(value) -> str:
    return str(len(value)) if isinstance(value, list) else type(value).__name__


def _instruction(batch, indices, kind: tuple[str, str], tokenizer, where: str, train_on_inputs: bool) -> dict:
    base, style = kind
    instruction_key, input_key, response_key, lead, needs_input = instructions.RECORDS[base]
    out = {"input_ids": [], "labels": []}
    wanted = f"{instruction_key}, {response_key} and {'' if needs_input else 'optionally '}{input_key}"
    fix = f"{base} records need {wanted}; fix the record or pick another type"
    for i, rec in zip(indices, _records(batch)):
        instruction = _field(rec, instruction_key, where, i, fix)
        response = lead + str(_field(rec, response_key, where, i, fix))
        extra = _field(rec, input_key, where, i, fix) if needs_input else rec.get(input_key) or ""
        prompt_ids = tokenizer(instructions.prompt(style, instruction, str(extra)))["input_ids"]
        answer = _with_eos(tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer)
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
        if isinstance(turn.get(spec.field_thinking), str):  # Axolotl's field_thinking -> template_thinking_key
            out[-1][spec.template_thinking_key] = turn[spec.field_thinking]
    if spec.drop_system_message and out and out[0]["role"] == "system":  # Axolotl drops the first turn only
        out = out[1:]
    return out


def _render(tokenizer, turns: list[dict], kwargs: dict) -> str:
    return tokenizer.apply_chat_template(turns, tokenize=False, **kwargs) if turns else ""


def _content_spans(tokenizer, turns: list[dict], full: str, thinking_key: str,
                   kwargs: dict) -> list[tuple[int, int]]:
    """Character span of each turn's content in `full`: found inside the text the turn adds to the rendering
    (rendering turns[:t] and turns[:t + 1]), so a content repeated in an earlier turn is not mistaken for it.
    Where the template renders the turn's reasoning (thinking_key) before its content, the span starts there:
    Axolotl trains a trained turn's reasoning with its content."""
    spans = []
    for t, turn in enumerate(turns):
        seg_start, seg_end = len(_render(tokenizer, turns[:t], kwargs)), len(_render(tokenizer, turns[:t + 1], kwargs))
        content = str(turn["content"])
        text = content if content in full[seg_start:seg_end] else content.strip()
        at = full.find(text, seg_start, seg_end) if text else -1
        thought = str(turn.get(thinking_key) or "").strip()
        begin = full.find(thought, seg_start, at) if thought and at > 0 else -1
        spans.append((begin if begin >= 0 else at, at + len(text)) if at >= 0 else (seg_end, seg_end))
    return spans


def _end_ids(tokenizer, eot_tokens: list[str] | None, where: str) -> tuple[set[int], int | None]:
    """(end-of-turn ids, eos id): Axolotl's eot_tokens, default the tokenizer's eos_token."""
    ids = set()
    for token in eot_tokens or [tokenizer.eos_token]:
        enc = tokenizer.encode(token, add_special_tokens=False) if token else []
        if len(enc) != 1:
            raise ConfigError(f"{where}: eot_tokens entry {token!r} is {len(enc)} tokens for this tokenizer, not "
                              f"one; list the tokenizer's own end-of-turn token, or add it with 'tokens: [{token}]'")
        ids.add(enc[0])
    return ids, tokenizer.eos_token_id


def _labels(ids, offsets, turns, spans, spec: DatasetSpec, train_on_inputs: bool, ends) -> list[int]:
    """Axolotl's chat_template labels: the content tokens of trained turns (roles_to_train, or every turn with
    train_on_inputs); then, per train_on_eos, the first end-of-turn token (eot_tokens) and the first eos token
    found within 3 tokens after each turn's content: "turn" (trained turns'), "all", "last" (the last turn's)
    or "none". Headers, separators and untrained turns are not trained."""
    eot_ids, eos_id = ends
    labels = [IGNORE_INDEX] * len(ids)
    last = {"eot": -1, "eos": -1}
    option = spec.train_on_eos
    for turn, (s, e) in zip(turns, spans):
        trained = train_on_inputs or turn["role"] in spec.roles_to_train
        if not trained and option != "all":
            continue
        inside = [k for k, (a, b) in enumerate(offsets) if s <= a and b <= e and b > a]
        if trained:
            for k in inside:
                labels[k] = ids[k]
        end = next((k for k, (a, _) in enumerate(offsets) if a >= e), len(ids))
        for kind, match in (("eot", lambda i: i in eot_ids), ("eos", lambda i: i == eos_id)):
            k = next((k for k in range(end, len(ids)) if match(ids[k])), -1)
            if k == -1 or k - end > 3:  # Axolotl allows a little template padding before the marker
                continue
            last[kind] = k
            if option == "all" or (option == "turn" and trained):
                labels[k] = ids[k]
    if option == "last":
        for k in last.values():
            if k != -1:
                labels[k] = ids[k]
    return labels


def _chat(batch, indices, spec: DatasetSpec, tokenizer, where: str, train_on_inputs: bool, eot_tokens,
          kwargs: dict) -> dict:
    if not tokenizer.chat_template:
        raise ConfigError(f"{where}: type: chat_template, but the tokenizer has no chat template; name one "
                          "(chat_template: chatml, llama3, ...), or use 'chat_template: jinja' with "
                          "'chat_template_jinja: ...'")
    ends = _end_ids(tokenizer, eot_tokens, where)
    out = {"input_ids": [], "labels": []}
    for i, rec in zip(indices, _records(batch)):
        turns = _turns(rec, spec, where, i)
        try:
            full = _render(tokenizer, turns, kwargs)
            spans = _content_spans(tokenizer, turns, full, spec.template_thinking_key, kwargs)
        except Exception as err:  # jinja raises its own errors (e.g. roles that must alternate)
            raise ConfigError(f"{where}, record {i}: the chat template refuses this conversation: {err}; fix the "
                              "record or the template") from None
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        out["input_ids"].append(enc["input_ids"])
        out["labels"].append(_labels(enc["input_ids"], enc["offset_mapping"], turns, spans, spec, train_on_inputs,
                                     ends))
    return out


def chunk_fn(sequence_len: int):
    """Batched `map` for pretraining: the batch's token streams joined and cut into sequence_len blocks."""

    def chunk(batch):
        ids = [t for row in batch["input_ids"] for t in row]
        blocks = [ids[i:i + sequence_len] for i in range(0, len(ids), sequence_len)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return chunk
