"""Run by Axolotl's interpreter (.venv-axolotl) from test_lm_eval.py: Axolotl 0.19's own ``Perplexity`` metric
(do_causal_lm_eval's "perplexity") of a saved model on a list of reference strings, printed as JSON.

    python axolotl_perplexity_dump.py spec.json    # {"model": dir, "references": [...], "max_seq_len": n}
"""

import json
import sys

import torch
from axolotl.utils.callbacks.perplexity import Perplexity
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    metric = Perplexity(tokenizer=tokenizer, max_seq_len=spec["max_seq_len"])
    print(json.dumps(metric.compute(model=model, references=spec["references"])))


if __name__ == "__main__":
    main()
