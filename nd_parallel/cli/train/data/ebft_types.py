"""Axolotl's own record transforms for `rl: ebft` (its prompt_strategies/ebft), written here from their documented
mapping; a module of the same name in the working directory (or the YAML's folder) is used instead, as Axolotl
imports the user's module first."""


def opencode(cfg, **kwargs):
    """``ebft_opencode.transform``: nvidia/OpenCodeInstruct records -> a one-turn chat prompt of ``input`` and the
    ``output`` as the ground truth; the record's other columns are dropped."""

    def row(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": example["input"]}], "ground_truth": example["output"]}

    return row, {"remove_columns": "__all__"}


TRANSFORMS = {"ebft_opencode.transform": opencode}
