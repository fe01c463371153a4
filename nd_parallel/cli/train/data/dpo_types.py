"""Preference pairs for `rl: dpo` / `ipo` in Axolotl's template-string types (``prompt_strategies/dpo/chatml.py``
and ``llama3.py``), as the prompt / chosen / rejected strings TRL's DPOTrainer reads.

``type: <template>.<strategy>``: the template writes the prompt as one user turn (after a system turn when the
record has a non-empty ``system``) followed by the assistant header, and ends each answer with the template's
end-of-turn token (data/kto.py's ``TEMPLATES``: Llama 3's and ChatML's documented formats). The strategy names the
record's fields:

=============  ===========================================================================================
default        user text: the first of ``prompt``, ``input``, ``question``, ``instruction`` the record has;
               answers: ``chosen`` (else ``chosen_response``) and ``rejected`` (else ``rejected_response``)
icr            ``input``; ``chosen``, ``rejected``
intel          ``question``; ``chosen``, ``rejected``
prompt_pairs   ``prompt``; ``chosen``, ``rejected``
ultra          ``prompt``; the second turn's ``content`` of the ``chosen`` / ``rejected`` conversations
argilla_chat   the first turn of ``chosen`` is the user text, the second turns are the answers (no system)
=============  ===========================================================================================
"""

from __future__ import annotations

from nd_parallel.config import ConfigError

from .kto import TEMPLATES

STRATEGIES = ("default", "icr", "intel", "prompt_pairs", "ultra", "argilla_chat")
TYPES = tuple(f"{t}.{s}" for t in TEMPLATES for s in STRATEGIES)
_USER = {"icr": "input", "intel": "question", "prompt_pairs": "prompt", "ultra": "prompt"}


def _second_turn(rec: dict, key: str, where: str, i: int, turn: int = 1) -> str:
    conversation = rec.get(key)
    if not (isinstance(conversation, list) and len(conversation) > turn and isinstance(conversation[turn], dict)
            and isinstance(conversation[turn].get("content"), str)):
        raise ConfigError(f"{where}, record {i}: {key!r} must be a conversation whose turn {turn} has a 'content' "
                          f"string (got {conversation!r}); fix the record or pick the strategy whose fields it has")
    return conversation[turn]["content"]


def _string(rec: dict, key: str, where: str, i: int) -> str:
    if not isinstance(rec.get(key), str):
        raise ConfigError(f"{where}, record {i}: {key!r} must be a string (got {rec.get(key)!r}); fix the record or "
                          "pick the strategy whose fields it has")
    return rec[key]


def _texts(rec: dict, strategy: str, where: str, i: int) -> tuple[str, str, str]:
    """(user text, chosen text, rejected text) of one record, Axolotl's field choices."""
    if strategy == "argilla_chat":
        return (_second_turn(rec, "chosen", where, i, 0), _second_turn(rec, "chosen", where, i),
                _second_turn(rec, "rejected", where, i))
    if strategy == "ultra":
        return (_string(rec, "prompt", where, i), _second_turn(rec, "chosen", where, i),
                _second_turn(rec, "rejected", where, i))
    if strategy == "default":  # Axolotl picks keys by presence in the record
        user = next((k for k in ("prompt", "input", "question") if k in rec), "instruction")
        chosen = "chosen" if "chosen" in rec else "chosen_response"
        rejected = "rejected" if "rejected" in rec else "rejected_response"
    else:
        user, chosen, rejected = _USER[strategy], "chosen", "rejected"
    return tuple(_string(rec, key, where, i) for key in (user, chosen, rejected))


def dpo_fn(spec, where: str):
    """A batched `map` function (with_indices=True) for ``spec`` (a DatasetSpec whose type is one of ``TYPES``):
    records -> prompt / chosen / rejected strings."""
    template, strategy = spec.type.split(".", 1)
    system_turn, user_turn, end = TEMPLATES[template]

    def fn(batch, indices):
        out = {"prompt": [], "chosen": [], "rejected": []}
        for i, rec in zip(indices, [dict(zip(batch, values)) for values in zip(*batch.values())]):
            user, chosen, rejected = _texts(rec, strategy, where, i)
            system = rec.get("system") if strategy != "argilla_chat" else None
            out["prompt"].append((system_turn.format(text=system) if system else "") + user_turn.format(text=user))
            out["chosen"].append(chosen + end)
            out["rejected"].append(rejected + end)
        return out

    return fn
