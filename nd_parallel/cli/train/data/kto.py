"""Unpaired preference examples for `rl: kto`: Axolotl's KTO dataset types, as the prompt / completion / label
strings TRL's KTOTrainer reads (it tokenizes them on the ranks and pairs prompts with mismatched completions for its
KL estimate).

``type: <template>.<strategy>`` (Axolotl's ``prompt_strategies/kto``): the template writes the prompt as one user
turn (after a system turn when the record has a non-empty ``system``) followed by the assistant header, and ends the
completion with the template's end-of-turn token; the strategy names the record's field holding the user text:

=============  ==================================================================
argilla        ``instruction``
intel          ``question``
prompt_pairs   ``prompt``
ultra          ``prompt``
argilla_chat   ``completion``: a two-turn conversation, user text then the answer
=============  ==================================================================

The answer is ``completion`` (a string) and ``label`` (true: desirable) is kept as it is. The templates' token
strings are Llama 3's and ChatML's documented chat formats.
"""

from __future__ import annotations

from nd_parallel.config import ConfigError

# template -> (system turn, user turn + assistant header, end of the completion); {text} is the turn's text
TEMPLATES = {
    "llama3": ("<|start_header_id|>system<|end_header_id|>\n\n{text}<|eot_id|>",
               "<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "chatml": ("<|im_start|>system\n{text}<|im_end|>\n", "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_end|>"),
}
USER_FIELD = {"argilla": "instruction", "intel": "question", "prompt_pairs": "prompt", "ultra": "prompt",
              "argilla_chat": None}
TYPES = tuple(f"{t}.{s}" for t in TEMPLATES for s in USER_FIELD)


def _texts(rec: dict, strategy: str, where: str, i: int) -> tuple[str, str]:
    """(user text, completion text) of one record."""
    if strategy == "argilla_chat":
        turns = rec.get("completion")
        if not (isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) and isinstance(
                t.get("content"), str) for t in turns[:2])):
            raise ConfigError(f"{where}, record {i}: argilla_chat reads 'completion' as a conversation of two turns "
                              f"with 'content' (the user's text, then the answer), got {turns!r}; fix the record "
                              "or use type: <template>.prompt_pairs with prompt / completion strings")
        return turns[0]["content"], turns[1]["content"]
    field = USER_FIELD[strategy]
    user, answer = rec.get(field), rec.get("completion")
    if not isinstance(user, str) or not isinstance(answer, str):
        raise ConfigError(f"{where}, record {i}: {strategy} reads the strings {field!r} and 'completion' (got "
                          f"{user!r}, {answer!r}); fix the record or pick the strategy whose fields it has "
                          f"({', '.join(f'{k}: {v}' for k, v in USER_FIELD.items() if v)})")
    return user, answer


def kto_fn(spec, where: str):
    """A batched `map` function (with_indices=True) for ``spec`` (a DatasetSpec whose type is one of ``TYPES``):
    records -> prompt / completion / label."""
    template, strategy = spec.type.split(".", 1)
    system_turn, user_turn, end = TEMPLATES[template]

    def fn(batch, indices):
        out = {"prompt": [], "completion": [], "label": []}
        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
        for i, rec in zip(indices, records):
            if not isinstance(rec.get("label"), bool):
                raise ConfigError(f"{where}, record {i}: KTO needs 'label' true (a desirable completion) or false "
                                  f"(an undesirable one), got {rec.get('label')!r}; fix the record")
            user, answer = _texts(rec, strategy, where, i)
            system = rec.get("system") if strategy != "argilla_chat" else None
            prompt = (system_turn.format(text=system) if system else "") + user_turn.format(text=user)
            out["prompt"].append(prompt)
            out["completion"].append(answer + end)
            out["label"].append(rec["label"])
        return out

    return fn
