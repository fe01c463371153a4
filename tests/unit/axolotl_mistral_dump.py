"""Run by Axolotl's interpreter (.venv-axolotl) from test_mistral_common.py: tokenize chat_template records with
Axolotl 0.19's own mistral-common path (HFMistralTokenizer + MistralStrategy, what tokenizer_use_mistral_common
selects) and print input_ids / labels per train_on_eos option as JSON.

    python axolotl_mistral_dump.py request.json    # {"tekken": path, "records": [...], "options": [...]}
"""

import json
import sys

from axolotl.prompt_strategies.chat_template import StrategyLoader
from axolotl.utils.dict import DictDefault
from axolotl.utils.mistral import HFMistralTokenizer


def main() -> None:
    data = json.load(open(sys.argv[1]))
    tokenizer = HFMistralTokenizer.from_pretrained(data["tekken"])
    cfg = DictDefault({"tokenizer_use_mistral_common": True, "train_on_inputs": False, "sequence_len": 4096})
    out = {}
    for option in data["options"]:
        strategy = StrategyLoader()(tokenizer, cfg, {"type": "chat_template", "train_on_eos": option})
        rows = [strategy.tokenize_prompt(r) for r in data["records"]]
        out[option] = [[r["input_ids"], r["labels"]] for r in rows]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
