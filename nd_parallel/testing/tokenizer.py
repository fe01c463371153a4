"""Tokenizers built locally (no hub): a tiny BPE for `nd-parallel make-tiny` and the tests, and the byte-level
fallback `nd-parallel train` uses for a checkpoint directory without tokenizer files.

Both are ``PreTrainedTokenizerFast`` objects, so the data pipeline treats them like any checkpoint's tokenizer.
Every id stays below 256, the vocabulary of the tiny models in models.py.
"""

from __future__ import annotations

import string

# ChatML, the template most chat checkpoints ship; {% generation %} is not used, so any template of this shape
# works with the pipeline's prefix-rendering (cli/train/data/formats.py).
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _wrap(tokenizer_object, **kwargs):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, **kwargs)


def train_tiny_tokenizer(texts, vocab_size: int = 200):
    """A byte-level BPE trained on ``texts`` with ChatML specials and template; ids < ``vocab_size`` (<= 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # Only the characters seen (not all 256 bytes) start the vocabulary, so merges fit under vocab_size.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    # Every printable ASCII character (newline included) gets a token, so templates and prompts never hit <unk>.
    bpe.train_from_iterator([string.printable, *texts], trainer)
    return _wrap(bpe, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                 chat_template=CHATML)

