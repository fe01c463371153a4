"""Axolotl's `tokenizer_use_mistral_common: true`: the checkpoint's mistral-common tokenizer (tekken.json or
tokenizer.model.v<N>) through transformers' MistralCommonBackend, in mistral-common's fine-tuning mode.

mistral-common renders a conversation itself (no Jinja template), so a `type: chat_template` record is encoded as
mistral-common encodes the chat request, and its labels are found on those tokens: each turn's tokens are where the
encoding changes when that turn's content is swapped for a stand-in (Axolotl's MistralStrategy finds them the same
way, on prefixes of the conversation; here on the whole conversation, so a system prompt that mistral-common moves
into the last user turn (tokenizers before v7) is found where it lands). Trained: the content of the turns of
roles_to_train (every turn with train_on_inputs) and, per train_on_eos, the </s> that ends a turn (mistral-common's
only end-of-turn token, as in Axolotl, where eot_tokens is not read with this tokenizer).

What Axolotl refuses with this tokenizer is refused here in the config stage (chat_template, special_tokens,
tokens), plus datasets other than chat_template or pre-tokenized ones. eot_tokens is not read, as in Axolotl
(one line says so).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path

from nd_parallel.config import ConfigError
from nd_parallel.distributed.loss import IGNORE_INDEX

from .formats import _records, _turns
from .sources import DatasetSpec

KEY = "tokenizer_use_mistral_common"
_SPM = re.compile(r"^tokenizer\.model\.v\d+m?\d*$")  # mistral-common's sentencepiece files (tokenizer.model.v3, ...)
# Two stand-ins that share neither their first nor their last token: a turn whose content begins or ends like one
# of them still differs from the other there, so the union of the two differences is exactly the turn's tokens.
_STAND_INS = ("[[dummy_message]]", "(stand-in)")
# Keys Axolotl refuses with this tokenizer (check_mistral_common_incompatible_options).
_CONFLICTS = {
    "chat_template": "mistral-common renders conversations itself (no chat template); drop chat_template",
    "chat_template_jinja": "mistral-common renders conversations itself (no chat template); drop chat_template_jinja",
    "special_tokens": "mistral-common's tokenizer cannot be edited (Axolotl refuses it too); drop special_tokens",
    "tokens": "mistral-common's tokenizer cannot be edited (Axolotl refuses it too); drop tokens",
}
_CHAT_TYPES = ("chat_template", "chat_template.default", None)  # None: `type:` left empty, pre-tokenized records


def config_refusals(d: dict) -> list[str]:
    """The config stage (no file opened): Axolotl's inference for Magistral names, then the key's refusals."""
    if d.get(KEY) is None and any("magistral" in str(d.get(k) or "").lower()
                                  for k in ("base_model", "base_model_config", "tokenizer_config")):
        d[KEY] = True  # Axolotl's check_tokenizer_use_mistral_common turns it on for Magistral checkpoints
    if not d.get(KEY):
        return []
    out = [f"{key}={d[key]!r} with {KEY}: {why}" for key, why in _CONFLICTS.items() if d.get(key)]
    if importlib.util.find_spec("mistral_common") is None:
        out.append(f"{KEY}: the mistral-common package is not installed; pip install 'nd_parallel[mistral]' (or "
                   "mistral-common), or drop the key to use the checkpoint's Hugging Face tokenizer")
    entries = d.get("datasets") if isinstance(d.get("datasets"), list) else [{"path": d.get("dataset_path")}]
    for i, entry in enumerate(entries):
        kind = entry.get("type", "completion") if isinstance(entry, dict) else "completion"
        if kind not in _CHAT_TYPES:
            out.append(f"datasets[{i}].type={kind!r} with {KEY}: mistral-common tokenizes conversations here "
                       "(type: chat_template, or pre-tokenized records); drop the key to read this type with the "
                       "checkpoint's Hugging Face tokenizer")
    return out


def tokenizer_file(folder: Path) -> Path | None:
    """tekken.json (mistral-common's preference), else the newest tokenizer.model.v<N> by version number (v11 after
    v3, where mistral-common's sort by name would take v3), else None."""
    if (folder / "tekken.json").is_file():
        return folder / "tekken.json"
    found = [p for p in folder.glob("tokenizer.model.v*") if _SPM.match(p.name) and p.is_file()]
    return max(found, key=lambda p: int(re.search(r"\d+", p.name.rsplit(".", 1)[1]).group())) if found else None


def load_tokenizer(folder: str | Path, *, mode: str = "finetuning"):
    """(MistralCommonBackend, how). Before any rank starts: a folder without the file stops the run here."""
    folder = Path(folder)
    path = tokenizer_file(folder)
    if path is None:
        raise ConfigError(f"{KEY}: {folder} has no mistral-common tokenizer file (tekken.json or "
                          "tokenizer.model.v<N>); copy the checkpoint's tekken.json into it, point tokenizer_config "
                          "at the folder that holds it, or drop the key (Axolotl also turns it on for names with "
                          f"'magistral': set {KEY}: false) to use the folder's Hugging Face tokenizer")
    if path.name != "tekken.json" and importlib.util.find_spec("sentencepiece") is None:
        raise ConfigError(f"{KEY}: {path} is a sentencepiece tokenizer, which mistral-common reads with the "
                          "sentencepiece package; pip install sentencepiece (or mistral-common[sentencepiece])")
    from transformers.tokenization_mistral_common import MistralCommonBackend

    # fine-tuning mode, as Axolotl: each assistant turn ends with </s>, and a conversation must end with one
    return MistralCommonBackend(tokenizer_path=str(path), mode=mode), f"mistral-common tokenizer {path}"


def is_mistral(tokenizer) -> bool:
    return any(c.__name__ == "MistralCommonBackend" for c in type(tokenizer).__mro__)


def fingerprint(tokenizer) -> str:
    return hashlib.sha256(Path(tokenizer._tokenizer_path).read_bytes()).hexdigest()


def saved(folder: Path) -> bool:
    """A tokenizer folder written by MistralCommonBackend.save_pretrained (its file, no tokenizer_config.json)."""
    return tokenizer_file(folder) is not None and not (folder / "tokenizer_config.json").is_file()


# ----------------------------------------------------------------------------------------------- tokenizing
def _encode(tokenizer, turns: list[dict], where: str, i: int) -> list[int]:
    try:
        return list(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False))
    except Exception as err:  # mistral-common's validator: roles out of order, no final assistant turn, ...
        raise ConfigError(f"{where}, record {i}: mistral-common refuses this conversation: {type(err).__name__}: "
                          f"{err}; fix the record (fine-tuning conversations alternate user/assistant after an "
                          "optional system turn and end with an assistant turn)") from None


def _span(full: list[int], other: list[int]) -> tuple[int, int]:
    """[start, end) of `full` that differs from `other` (common prefix and suffix removed)."""
    start = next((k for k, (a, b) in enumerate(zip(full, other)) if a != b), min(len(full), len(other)))
    tail = 0
    while tail < min(len(full), len(other)) - start and full[-1 - tail] == other[-1 - tail]:
        tail += 1
    return start, len(full) - tail


def turn_spans(tokenizer, turns: list[dict], full: list[int], where: str, i: int) -> list[tuple[int, int]]:
    """Token span of each turn's content in `full` (empty where the turn renders no content)."""
    spans = []
    for t, turn in enumerate(turns):
        cuts = [_span(full, _encode(tokenizer, [*turns[:t], {**turn, "content": s}, *turns[t + 1:]], where, i))
                for s in _STAND_INS]
        start, end = min(c[0] for c in cuts), max(c[1] for c in cuts)
        spans.append((start, end) if start < end else (end, end))
    return spans


def labels_for(ids: list[int], turns: list[dict], spans, spec: DatasetSpec, train_on_inputs: bool,
               eos_id: int) -> list[int]:
    """Axolotl's chat_template labels on token spans, with </s> as the end-of-turn token (see the docstring)."""
    labels, last, option = [IGNORE_INDEX] * len(ids), -1, spec.train_on_eos
    for turn, (start, end) in zip(turns, spans):
        trained = train_on_inputs or turn["role"] in spec.roles_to_train
        if start == end or (not trained and option != "all"):
            continue
        if trained:
            labels[start:end] = ids[start:end]
        k = next((k for k in range(end, len(ids)) if ids[k] == eos_id), -1)
        if k == -1 or k - end > 3:  # Axolotl allows a little template padding before the marker
            continue
        last = k
        if option == "all" or (option == "turn" and trained):
            labels[k] = ids[k]
    if option == "last" and last != -1:
        labels[last] = ids[last]
    return labels


def chat_fn(spec: DatasetSpec, tokenizer, where: str, *, train_on_inputs: bool):
    """A batched `map` function (with_indices=True) for `type: chat_template` with mistral-common."""

    def chat(batch, indices):
        out = {"input_ids": [], "labels": []}
        for i, rec in zip(indices, _records(batch)):
            turns = _turns(rec, spec, where, i)
            if any(spec.template_thinking_key in turn for turn in turns):
                raise ConfigError(f"{where}, record {i}: a turn holds {spec.field_thinking!r}, which mistral-common "
                                  "does not read; write the reasoning as a content chunk (content: [{type: "
                                  "thinking, thinking: ...}, {type: text, text: ...}]) or drop it")
            ids = _encode(tokenizer, turns, where, i)
            spans = turn_spans(tokenizer, turns, ids, where, i)
            out["input_ids"].append(ids)
            out["labels"].append(labels_for(ids, turns, spans, spec, train_on_inputs, tokenizer.eos_token_id))
        return out

    return chat
