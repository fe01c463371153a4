"""Run by Axolotl's interpreter (.venv-axolotl) from test_orpo_config.py: render the records of a json file with
Axolotl 0.19's own ``chat_template.argilla`` ORPO transform and print its prompt / chosen / rejected strings and the
chat template it used, as JSON.

    python axolotl_orpo_dump.py records.json    # {"tokenizer": dir, "chat_template": name, "records": [...]}
"""

import json
import sys

from axolotl.prompt_strategies.orpo.chat_template import argilla
from axolotl.utils.chat_templates import get_chat_template_from_config
from axolotl.utils.dict import DictDefault
from transformers import AutoTokenizer


def main() -> None:
    data = json.load(open(sys.argv[1]))
    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"])
    cfg = DictDefault({"chat_template": data["chat_template"]})
    transform = argilla(cfg)
    rows = [transform(r, tokenizer=tokenizer) for r in data["records"]]
    print(json.dumps({"template": get_chat_template_from_config(cfg=cfg, tokenizer=tokenizer),
                      "rows": [[r["prompt"], r["chosen"], r["rejected"]] for r in rows]}))


if __name__ == "__main__":
    main()
