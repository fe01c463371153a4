"""Axolotl's own record transforms for `rl: ebft` (its examples/ebft modules), written here from their documented
mapping; a module of the same name in the working directory (or the YAML's folder) is used instead, as Axolotl
imports the user's module first."""


def opencode(cfg, **kwargs):
    """``ebft_opencode.transform``: nvidia/OpenCodeInstruct records -> a one-turn chat prompt of ``input`` and the
    ``output`` as the ground truth; the record's other columns are dropped."""

    def row(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": example["input"]}], "ground_truth": example["output"]}

    return row, {"remove_columns": "__all__"}


def pretrain(cfg, **kwargs):
    """``ebft_pretrain.transform`` (strided mode): a record's ``question`` (else ``text``) tokenized with the
    tokenizer's special tokens, cut and padded to sequence_len; every token is a label (padding too, as there)."""

    def row(example, tokenizer=None):
        text = example.get("question", example.get("text", ""))
        ids = tokenizer(text, truncation=True, max_length=cfg.sequence_len, padding="max_length",
                        add_special_tokens=True)["input_ids"]
        return {"input_ids": ids, "labels": list(ids)}

    return row, {"remove_columns": ["question", "answer"]}


def strided_structured(cfg, **kwargs):
    """``ebft_strided_structured.transform`` (strided mode): the prompt (``input`` / ``prompt`` / ``question``, with
    the tokenizer's special tokens) followed by the completion (``output`` / ``completion`` / ``answer``, without),
    the completion cut to fit sequence_len (a prompt that fills it keeps sequence_len - 1 tokens and one completion
    token), padded to sequence_len; labels on the completion only; ``prompt_length`` places the anchors."""

    def row(example, tokenizer=None):
        prompt = example.get("input", example.get("prompt", example.get("question", "")))
        completion = example.get("output", example.get("completion", example.get("answer", "")))
        pad = tokenizer.pad_token_id or tokenizer.eos_token_id  # Axolotl's rule (a pad id of 0 reads as unset)
        head = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        tail = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if len(head) + len(tail) > cfg.sequence_len:
            room = cfg.sequence_len - len(head)
            head, tail = (head, tail[:room]) if room >= 1 else (head[:cfg.sequence_len - 1], tail[:1])
        fill = cfg.sequence_len - len(head) - len(tail)
        return {"input_ids": head + tail + [pad] * fill, "labels": [-100] * len(head) + tail + [-100] * fill,
                "prompt_length": len(head)}

    return row, {"remove_columns": "__all__"}


TRANSFORMS = {"ebft_opencode.transform": opencode, "ebft_pretrain.transform": pretrain,
              "ebft_strided_structured.transform": strided_structured}
