"""Records for reward models, with Axolotl's meanings (its ``prompt_strategies/bradley_terry/chat_template.py`` and
``prompt_strategies/stepwise_supervised.py``); used with `Dataset.map` in the parent, before any rank starts.

- ``bradley_terry.chat_template`` (``reward_model: true``): a record's ``system`` (optional), ``input``, ``chosen``
  and ``rejected`` strings become two conversations, [system,] user, assistant, each rendered and tokenized by the
  chat template (the ids of the prompt with the generation prompt, then the rest of the whole conversation's ids)
  and cut to ``sequence_len`` tokens: ``chosen_ids`` / ``rejected_ids``, which TRL's RewardTrainer reads as they
  are. As in Axolotl, a dataset with a ``system`` column gives every record a system turn, empty ones included.
- ``stepwise_supervised`` (``process_reward_model: true``): ``prompt``, ``completions`` (the steps) and ``labels``
  (one boolean per step). input_ids = [bos] + the prompt's tokens + each step's tokens followed by the tokens of
  ``step_separator``; each step's label (0 or 1) sits on its last token (the separator's last token), every other
  token is -100. ``train_on_last_step_only`` keeps the last step's label only; ``max_completion_length`` cuts the
  steps' tokens, then ``sequence_len`` the whole sequence. A record whose steps and labels differ in number is
  refused (Axolotl's zip would leave its labels shorter than its tokens).
"""

from __future__ import annotations

from itertools import chain

from nd_parallel.config import ConfigError
from nd_parallel.distributed.loss import IGNORE_INDEX

from .formats import _field, _records
from .sources import REWARD_TYPES

BRADLEY_TERRY, STEPWISE = REWARD_TYPES


def _conversation_ids(tokenizer, turns: list[dict]) -> list[int]:
    """Axolotl's ChatTemplateStrategy (no per-turn training keys): the prompt's ids with the generation prompt, then
    the whole conversation's ids past that length."""
    prompt = tokenizer.apply_chat_template(turns[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False)
    return list(prompt) + list(full[len(prompt):])


def bradley_terry_fn(tokenizer, where: str, sequence_len: int):
    """A batched `map` function (with_indices=True): records -> chosen_ids / rejected_ids."""
    if not tokenizer.chat_template:
        raise ConfigError(f"{where}: {BRADLEY_TERRY} renders the pairs with a chat template, but the tokenizer has "
                          "none; name one (chat_template: chatml, llama3, ...) or give chat_template_jinja")
    fix = "bradley_terry.chat_template reads the strings 'input', 'chosen' and 'rejected' (and 'system' if present)"

    def fn(batch, indices):
        out = {"chosen_ids": [], "rejected_ids": []}
        for i, rec in zip(indices, _records(batch)):
            user = _field(rec, "input", where, i, fix)
            head = [{"role": "system", "content": rec["system"]}] if "system" in rec else []
            for key in ("chosen", "rejected"):
                turns = [*head, {"role": "user", "content": user},
                         {"role": "assistant", "content": _field(rec, key, where, i, fix)}]
                try:
                    ids = _conversation_ids(tokenizer, turns)
                except Exception as err:  # jinja raises its own errors (e.g. a template without a system role)
                    raise ConfigError(f"{where}, record {i}: the chat template refuses this pair: {err}; fix the "
                                      "record or the template") from None
                out[f"{key}_ids"].append(ids[:sequence_len])  # Axolotl cuts (and warns), it does not drop
        return out

    return fn


def stepwise_fn(spec, tokenizer, where: str, sequence_len: int):
    """A batched `map` function (with_indices=True): records -> input_ids / labels (module docstring)."""
    separator = tokenizer.encode(spec.step_separator, add_special_tokens=False)
    fix = "stepwise_supervised reads 'prompt' (a string), 'completions' (a list of steps) and 'labels' (one per step)"

    def fn(batch, indices):
        out = {"input_ids": [], "labels": []}
        for i, rec in zip(indices, _records(batch)):
            prompt, steps, marks = (_field(rec, k, where, i, fix) for k in ("prompt", "completions", "labels"))
            if not isinstance(steps, list) or not isinstance(marks, list):
                raise ConfigError(f"{where}, record {i}: 'completions' and 'labels' must be lists (got "
                                  f"{type(steps).__name__}, {type(marks).__name__}); {fix}")
            if len(steps) != len(marks):
                raise ConfigError(f"{where}, record {i}: {len(steps)} steps but {len(marks)} labels; give one label "
                                  "per step")
            marks = [int(m) for m in marks]
            if spec.train_on_last_step_only:
                marks = [IGNORE_INDEX] * (len(marks) - 1) + marks[-1:]
            pieces = [tokenizer(str(s), add_special_tokens=False)["input_ids"] + separator for s in steps]
            completion = list(chain(*pieces))
            labels = list(chain(*([IGNORE_INDEX] * (len(p) - 1) + [m] for p, m in zip(pieces, marks))))
            if spec.max_completion_length:
                completion, labels = completion[:spec.max_completion_length], labels[:spec.max_completion_length]
            prompt_ids = tokenizer(str(prompt), add_special_tokens=False)["input_ids"]
            if tokenizer.bos_token_id is not None:
                prompt_ids = [tokenizer.bos_token_id] + prompt_ids
            out["input_ids"].append((prompt_ids + completion)[:sequence_len])
            out["labels"].append(([IGNORE_INDEX] * len(prompt_ids) + labels)[:sequence_len])
        return out

    return fn


def reward_fn(spec, tokenizer, where: str, sequence_len: int):
    """The `map` function of a reward-model dataset type."""
    if spec.type == BRADLEY_TERRY:
        return bradley_terry_fn(tokenizer, where, sequence_len)
    return stepwise_fn(spec, tokenizer, where, sequence_len)
