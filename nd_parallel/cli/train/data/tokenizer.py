"""The run's tokenizer: the checkpoint's (or tokenizer_config's), with the YAML's special tokens, tokens and chat
template applied; a byte-level one (byte_tokenizer, below) for a directory without tokenizer files."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

from nd_parallel.config import ConfigError

from . import mistral
from .templates import resolve_template

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_config(cfg) -> dict:
    path = Path(cfg.base_model_config or cfg.base_model) / "config.json"
    if not path.is_file():
        raise ConfigError(f"base_model {cfg.base_model!r} is not a Hugging Face checkpoint directory (no "
                          f"{path.name}); point it at a local checkpoint, or create a tiny one with "
                          "`nd-parallel make-tiny DIR`")
    config = json.loads(path.read_text())
    return config.get("text_config", config) if "vocab_size" not in config else config


def check_sequence_len(cfg) -> None:
    limit = model_config(cfg).get("max_position_embeddings")
    if limit is not None and cfg.sequence_len > limit:
        raise ConfigError(f"sequence_len={cfg.sequence_len} is beyond the model's max_position_embeddings={limit} "
                          f"({cfg.base_model_config or cfg.base_model}/config.json); use sequence_len <= {limit}")


def load_tokenizer(cfg):
    """(tokenizer, how the text is tokenized)."""
    source = cfg.tokenizer_config or cfg.base_model
    if cfg.tokenizer_use_mistral_common:  # no template, special tokens or added tokens (refused with the key)
        tokenizer, how = mistral.load_tokenizer(source)
        _check_vocab(cfg, tokenizer, source)
        if cfg.eot_tokens:  # Axolotl's MistralStrategy looks for </s> only
            how += f"; eot_tokens {cfg.eot_tokens} not read: </s> ends each assistant turn (as in Axolotl)"
        return tokenizer, how
    if any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        extra = {} if cfg.trust_remote_code is None else {"trust_remote_code": cfg.trust_remote_code}
        # mistral_format=False: transformers would pick mistral-common's tokenizer for a folder with a tekken.json
        # whenever that package is installed; without tokenizer_use_mistral_common the HF tokenizer is the one read
        with _overridden(source, cfg.added_tokens_overrides) as files:  # added_tokens_overrides, else source
            tokenizer = AutoTokenizer.from_pretrained(files, mistral_format=False, **extra)
        how = f"tokenizer of {source}" + (f", added tokens {sorted(cfg.added_tokens_overrides)} renamed"
                                          if cfg.added_tokens_overrides else "")
    else:
        tokenizer, how = byte_tokenizer(), f"byte-level ids: no tokenizer files in {source}"
    template = resolve_template(cfg.chat_template, cfg.chat_template_jinja, tokenizer)
    if template is not None:  # a named template (templates.py), jinja, or a fallback for a tokenizer without one
        tokenizer.chat_template = template
    if cfg.special_tokens:
        tokenizer.add_special_tokens(dict(cfg.special_tokens))
    if cfg.tokens:
        tokenizer.add_tokens(list(cfg.tokens))
    if tokenizer.pad_token is None:  # Axolotl's habit too: padding is never trained on, so EOS may stand in
        tokenizer.pad_token = tokenizer.eos_token
    if not (cfg.special_tokens or cfg.tokens):
        _check_vocab(cfg, tokenizer, source)
    return tokenizer, how


@contextlib.contextmanager
def _overridden(source: str, overrides: dict | None):
    """Axolotl's added_tokens_overrides: a copy of the tokenizer files whose added tokens with these ids carry the
    new strings (tokenizer_config.json's added_tokens_decoder, tokenizer.json's added_tokens and vocab); only added
    tokens can be renamed. Yields the folder to load from (`source` itself without overrides)."""
    if not overrides:
        yield source
        return
    ids = {int(k): v for k, v in overrides.items()}
    with tempfile.TemporaryDirectory() as folder:
        for file in Path(source).iterdir():
            if file.is_file() and file.suffix in (".json", ".model", ".txt", ".jinja"):
                shutil.copy(file, folder)
        config_file, main_file = Path(folder) / "tokenizer_config.json", Path(folder) / "tokenizer.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        main = json.loads(main_file.read_text()) if main_file.is_file() else {}
        added = {entry["id"]: entry for entry in main.get("added_tokens", [])}
        missing = sorted(i for i in ids if str(i) not in config.get("added_tokens_decoder", {}) and i not in added)
        if missing:
            raise ConfigError(f"added_tokens_overrides: token ids {missing} are not added tokens of {source} (only "
                              "added tokens, e.g. reserved special tokens, can be renamed); use ids from its "
                              "tokenizer_config.json added_tokens_decoder")
        for i, text in ids.items():
            config.get("added_tokens_decoder", {}).get(str(i), {})["content"] = text
            if i in added:
                added[i]["content"] = text
            vocab = main.get("model", {}).get("vocab")
            if isinstance(vocab, dict):  # the vocabulary's entry for that id takes the new string too (as Axolotl)
                old = next((k for k, v in vocab.items() if v == i), None)
                if old is not None:
                    del vocab[old]
                    vocab[text] = i
        for file, data in ((config_file, config), (main_file, main)):
            if data:
                file.write_text(json.dumps(data))
        yield folder


def _check_vocab(cfg, tokenizer, source) -> None:
    vocab = model_config(cfg).get("vocab_size")
    top = max(tokenizer.get_vocab().values())
    if vocab is not None and top >= vocab:
        raise ConfigError(f"the tokenizer of {source} has ids up to {top}, beyond the model's vocab_size={vocab}; "
                          "use the checkpoint's own tokenizer (tokenizer_config)")


def byte_tokenizer():
    """One token per UTF-8 byte (ids 2-255 are the byte values), <pad> = 0 and </s> = 1 in place of the two
    control bytes no text uses: what `nd-parallel train` did before it read tokenizers, kept for checkpoint
    directories that have none. It has no chat template, so chat_template datasets need a real tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    # The byte -> printable-character map ByteLevel uses; position i of the alphabet is not byte i, so rebuild it.
    to_char = _bytes_to_unicode()
    vocab = {to_char[b]: b for b in range(2, 256)} | {"<pad>": 0, "</s>": 1}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens(["<pad>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="</s>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> character table (the one tokenizers' ByteLevel pre-tokenizer applies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
