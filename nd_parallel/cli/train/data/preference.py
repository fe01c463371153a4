"""Preference pairs for `rl: dpo`: Axolotl's ``chat_template.default`` DPO strategy, as the strings TRL's DPOTrainer
reads (``prompt`` / ``chosen`` / ``rejected``), rendered with the YAML's chat template; DPOTrainer tokenizes them on
the ranks (its prompt + completion tokenization and truncation to ``max_length``).

A record holds the conversation so far under ``field_messages`` (a list of turns, or a string: one user turn) and
the two answers under ``field_chosen`` / ``field_rejected`` (a string, one turn, or a conversation whose last turn is
the answer), with the entry's ``message_property_mappings`` and ``roles``. As Axolotl renders them: the prompt is the
conversation with the template's generation prompt; each answer is the template's rendering of a one-turn exchange
cut to start at the answer's text (so it keeps the template's end-of-turn tokens) and stripped of trailing space.
"""

from __future__ import annotations

from nd_parallel.config import ConfigError

from .formats import _field, _records, _turns
from .sources import DatasetSpec

PLACEHOLDER = {"role": "user", "content": "[[dummy_message]]"}  # Axolotl's: only the answer is kept from its render


def _answer(raw, spec: DatasetSpec, where: str, i: int, key: str) -> dict:
    """The answer turn of ``raw`` (Axolotl's forms: a string, one turn, or a conversation ending with it)."""
    if isinstance(raw, str):
        return {"role": "assistant", "content": raw}
    turn = raw[-1] if isinstance(raw, list) and raw else raw
    if not isinstance(turn, dict) or turn.get(spec.role_key) is None or turn.get(spec.content_key) is None:
        raise ConfigError(f"{where}, record {i}: {key} must be a string, a turn with keys {spec.role_key!r} and "
                          f"{spec.content_key!r}, or a list of turns (got {raw!r}); fix the record or "
                          "message_property_mappings")
    role = spec.role_map.get(turn[spec.role_key])
    if role is None:
        raise ConfigError(f"{where}, record {i}: {key}'s role {turn[spec.role_key]!r} is not one the chat template "
                          f"knows ({', '.join(sorted(spec.role_map))}); map it under roles:")
    return {"role": role, "content": turn[spec.content_key]}


def _rendered_answer(tokenizer, answer: dict) -> str:
    text = tokenizer.apply_chat_template([PLACEHOLDER, answer], tokenize=False)
    start = text.find(answer["content"])
    return (text[start:] if start >= 0 else text).rstrip()


def preference_fn(spec: DatasetSpec, tokenizer, where: str):
    """A batched `map` function (with_indices=True): records -> prompt / chosen / rejected strings."""
    if not tokenizer.chat_template:
        raise ConfigError(f"{where}: rl: dpo renders the pairs with a chat template, but the tokenizer has none; "
                          "name one (chat_template: chatml, llama3, ...) or give chat_template_jinja")

    def fn(batch, indices):
        out = {"prompt": [], "chosen": [], "rejected": []}
        for i, rec in zip(indices, _records(batch)):
            messages = rec.get(spec.field_messages)  # Axolotl: a string is one user turn
            turns = [{"role": "user", "content": messages}] if isinstance(messages, str) else _turns(
                rec, spec, where, i)
            fix = "set field_chosen / field_rejected to the columns holding the two answers"
            chosen = _answer(_field(rec, spec.field_chosen, where, i, fix), spec, where, i, spec.field_chosen)
            rejected = _answer(_field(rec, spec.field_rejected, where, i, fix), spec, where, i, spec.field_rejected)
            try:
                out["prompt"].append(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
                out["chosen"].append(_rendered_answer(tokenizer, chosen))
                out["rejected"].append(_rendered_answer(tokenizer, rejected))
            except Exception as err:  # jinja raises its own errors (e.g. roles that must alternate)
                raise ConfigError(f"{where}, record {i}: the chat template refuses this pair: {err}; fix the record "
                                  "or the template") from None
        return out

    return fn
