"""Run by Axolotl's interpreter (.venv-axolotl) from test_reward_data.py: tokenize records with Axolotl 0.19's own
reward-model strategies (bradley_terry.chat_template, stepwise_supervised) and print what they return as JSON.

    python axolotl_reward_dump.py request.json
    # {"model": dir, "len": N, "pairs": [...], "steps": [...], "stepwise": [{ds_cfg}, ...]}
"""

import json
import sys

from axolotl.prompt_strategies import bradley_terry, stepwise_supervised
from axolotl.utils.dict import DictDefault
from transformers import AutoTokenizer


def main() -> None:
    data = json.load(open(sys.argv[1]))
    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    cfg = DictDefault({"sequence_len": data["len"], "reward_model": True, "chat_template": "tokenizer_default",
                       "train_on_inputs": False})
    bt = bradley_terry.load("chat_template", tokenizer, cfg, DictDefault({}))
    pairs = []
    for record in data["pairs"]:
        row = bt.tokenize_prompt(dict(record))
        pairs.append([row["chosen_ids"], row["rejected_ids"]])
    steps = {}
    for i, ds_cfg in enumerate(data["stepwise"]):
        strategy = stepwise_supervised.load(tokenizer, DictDefault({"sequence_len": data["len"]}), DictDefault(ds_cfg))
        steps[str(i)] = [[r["input_ids"], r["labels"]] for r in map(strategy.tokenize_prompt, data["steps"])]
    print(json.dumps({"pairs": pairs, "steps": steps}))


if __name__ == "__main__":
    main()
