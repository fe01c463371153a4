"""added_tokens_overrides (cli/train/data/tokenizer.py): the tokenizer's added tokens renamed by id, the same tokenizer
as Axolotl 0.19's modify_tokenizer_files gives (run in its venv: the same ids for the same text, the same added
vocabulary); ids that are not added tokens and bad values are refused."""

import json

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import write_model_and_data, write_yaml
from tests.unit.axolotl_venv import run_in_axolotl

TEXT = "<|tool_call|>user hello<|tool_result|> <|reserved_2|>"
_AXOLOTL = """
import json, sys
from transformers import AutoTokenizer
from axolotl.loaders.tokenizer import modify_tokenizer_files
path, out, overrides, text = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
tok = AutoTokenizer.from_pretrained(modify_tokenizer_files(path, overrides, output_dir=out))
print(json.dumps({"ids": tok(text)["input_ids"], "added": tok.get_added_vocab()}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("added_tokens")
    data = write_model_and_data(root, n=8)
    tok = AutoTokenizer.from_pretrained(data["model"])
    tok.add_special_tokens({"additional_special_tokens": [f"<|reserved_{i}|>" for i in range(4)]})
    tok.save_pretrained(data["model"])
    return data, {tok.convert_tokens_to_ids(f"<|reserved_{i}|>"): f"<|reserved_{i}|>" for i in range(4)}


def test_renamed_tokens_equal_axolotls(model, tmp_path):
    from nd_parallel.cli.train.data.tokenizer import load_tokenizer

    data, reserved = model
    first, second = sorted(reserved)[:2]
    overrides = {first: "<|tool_call|>", second: "<|tool_result|>"}
    cfg = load_train_config(write_yaml(tmp_path / "c.yml", {
        "base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}],
        "added_tokens_overrides": overrides}), environ={})
    ours, how = load_tokenizer(cfg)
    theirs = run_in_axolotl("-c", _AXOLOTL, data["model"], str(tmp_path / "ax"), json.dumps(overrides), TEXT,
                            timeout=600)
    assert ours(TEXT)["input_ids"] == theirs["ids"]
    assert ours.get_added_vocab() == {k: v for k, v in theirs["added"].items()}
    assert ours.convert_tokens_to_ids("<|tool_call|>") == first and "renamed" in how


def test_bad_overrides_are_refused(model, tmp_path):
    from nd_parallel.cli.train.data.tokenizer import load_tokenizer

    data, _ = model
    base = {"base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}]}
    cfg = load_train_config(write_yaml(tmp_path / "a.yml", {**base, "added_tokens_overrides": {150: "<x>"}}),
                            environ={})
    with pytest.raises(ConfigError, match=r"token ids \[150\] are not added tokens"):
        load_tokenizer(cfg)
    with pytest.raises(ConfigError, match="write a mapping of token ids to new strings"):
        load_train_config(write_yaml(tmp_path / "b.yml", {**base, "added_tokens_overrides": ["<x>"]}), environ={})
