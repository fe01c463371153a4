"""Reward functions and the prompt transform that llama3_gdpo_lora_fsdp2.yml names (rl: gdpo), written for these
tests in the form Axolotl documents for GRPO: ``type: rwd.gsm8k_transform`` and ``trl.reward_funcs: [rwd.<name>]``
are imported from the working directory (or the YAML's folder). Records are GSM8K-shaped: a question, and an answer
whose worked solution ends with the line ``#### <number>``. Both rewards give partial credit, so that a tiny random
model's completions score differently within a group (GRPO learns nothing from equal rewards)."""

import re


def gsm8k_transform(cfg, dataset_idx=0):
    """Axolotl's contract: (row function, map kwargs); the row function gives each record its chat prompt."""

    def row(example):
        solution, _, answer = example["answer"].rpartition("####")
        return {"prompt": [{"role": "system", "content": "Answer, then end with #### and the number."},
                           {"role": "user", "content": example["question"]}], "answer": answer.strip(),
                "solution": solution.strip()}

    return row, {"remove_columns": ["question"]}


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """1 where the completion ends with '#### <number>'; else the share of its words that are short (a terse
    answer)."""
    out = []
    for c in completions:
        words = _text(c).split()
        out.append(1.0 if re.search(r"####\s*-?\d+\s*$", _text(c)) else
                   sum(len(w) <= 4 for w in words) / max(1, len(words)))
    return out


def correctness_reward(prompts, completions, answer, solution, **kwargs) -> list[float]:
    """1 where the number after '####' is the answer; else half the share of the solution's letters the completion
    uses."""
    out = []
    for c, want, worked in zip(completions, answer, solution):
        found = re.search(r"####\s*(-?\d+)", _text(c))
        letters = set(worked.lower()) - set(" \n")
        out.append(1.0 if found and found.group(1) == want else
                   0.5 * len(letters & set(_text(c).lower())) / max(1, len(letters)))
    return out
