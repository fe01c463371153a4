"""Preference pairs for `rl: orpo`: Axolotl's ``chat_template.argilla`` ORPO type (``prompt_strategies/orpo``), as
the prompt / chosen / rejected strings TRL's ORPOTrainer reads (it tokenizes prompt + answer on the ranks).

A record holds two conversations, ``chosen`` and ``rejected`` (lists of turns with ``content``, alternating user and
assistant, ending with the answer), the same up to their last turn; an optional ``system`` string, and an optional
``prompt`` string that stands for every user turn's text. As Axolotl renders them with the YAML's chat template:

- the prompt is the system turn (if any), then the user / assistant turns of ``chosen`` but its last answer, with the
  template's generation prompt; the turns' ``role`` fields are not read (Axolotl writes user and assistant in turn);
- each answer is the rendering of the prompt's turns plus that conversation's last turn, without the generation
  prompt, from the prompt's length on (so it keeps the template's end-of-turn text); rejected's earlier turns are
  not read.
"""

from __future__ import annotations

from nd_parallel.config import ConfigError

TYPES = ("chat_template.argilla",)


def _content(turn, where: str, i: int, key: str) -> str:
    if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
        raise ConfigError(f"{where}, record {i}: every turn of {key!r} needs a 'content' string (got {turn!r}); fix "
                          "the record")
    return turn["content"]


def _conversations(rec: dict, where: str, i: int) -> tuple[list, str, str]:
    """(the prompt's turns, chosen's answer, rejected's answer) of one record."""
    chosen, rejected = rec.get("chosen"), rec.get("rejected")
    if not (isinstance(chosen, list) and chosen and len(chosen) % 2 == 0 and isinstance(rejected, list) and rejected):
        raise ConfigError(f"{where}, record {i}: chat_template.argilla reads 'chosen' and 'rejected' as conversations "
                          "of alternating user / assistant turns ending with the answer ('chosen' an even number of "
                          f"them), got chosen={chosen!r}, rejected={rejected!r}; fix the record")
    texts = [_content(t, where, i, "chosen") for t in chosen]
    system, prompt = rec.get("system"), rec.get("prompt")
    turns = [{"role": "system", "content": system}] if system else []
    for k in range(len(chosen) // 2):
        turns.append({"role": "user", "content": prompt if isinstance(prompt, str) else texts[2 * k]})
        if k < len(chosen) // 2 - 1:
            turns.append({"role": "assistant", "content": texts[2 * k + 1]})
    return turns, texts[-1], _content(rejected[-1], where, i, "rejected")


def argilla_fn(tokenizer, where: str):
    """A batched `map` function (with_indices=True): records -> prompt / chosen / rejected strings."""
    if not tokenizer.chat_template:
        raise ConfigError(f"{where}: chat_template.argilla renders the pairs with a chat template, but the tokenizer "
                          "has none; name one (chat_template: chatml, llama3, ...) or give chat_template_jinja")

    def render(turns, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=generation_prompt, tokenize=False)

    def fn(batch, indices):
        out = {"prompt": [], "chosen": [], "rejected": []}
        for i, rec in zip(indices, [dict(zip(batch, values)) for values in zip(*batch.values())]):
            turns, chosen, rejected = _conversations(rec, where, i)
            try:
                prompt = render(turns, True)
                out["chosen"].append(render([*turns, {"role": "assistant", "content": chosen}], False)[len(prompt):])
                out["rejected"].append(render([*turns, {"role": "assistant", "content": rejected}], False)[
                    len(prompt):])
            except Exception as err:  # jinja raises its own errors (e.g. roles that must alternate)
                raise ConfigError(f"{where}, record {i}: the chat template refuses this pair: {err}; fix the record "
                                  "or the template") from None
            out["prompt"].append(prompt)
        return out

    return fn
