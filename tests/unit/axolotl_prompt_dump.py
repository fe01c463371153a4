"""Run by Axolotl's interpreter (.venv-axolotl) from test_axolotl_formats.py: tokenize the records of a json file
with Axolotl 0.19's own instruction strategies and print input_ids / labels per type as JSON.

    python axolotl_prompt_dump.py records.json    # {"model": dir, "alpaca": [...], "jeopardy": [...], "len": N}
"""

import json
import sys

from axolotl.prompt_tokenizers import AlpacaPromptTokenizingStrategy, JeopardyPromptTokenizingStrategy
from axolotl.prompters import AlpacaPrompter, JeopardyPrompter
from transformers import AutoTokenizer

STRATEGIES = {"alpaca": (AlpacaPromptTokenizingStrategy, AlpacaPrompter),
              "jeopardy": (JeopardyPromptTokenizingStrategy, JeopardyPrompter)}


def main() -> None:
    data = json.load(open(sys.argv[1]))
    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    out = {}
    for kind, (strategy, prompter) in STRATEGIES.items():
        for style in ("instruct", "chat", "chatml", "phi"):
            for train_on_inputs in (False, True):
                s = strategy(prompter(style), tokenizer, train_on_inputs, data["len"])
                rows = [s.tokenize_prompt(r) for r in data[kind]]
                out[f"{kind}:{style}:{train_on_inputs}"] = [[r["input_ids"], r["labels"]] for r in rows]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
