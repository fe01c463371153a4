"""fix_untrained_tokens (models/untrained_tokens.py) changes the same embedding and lm_head rows to the same numbers
as Axolotl 0.19's own ``axolotl.contribs.lgpl.fix_untrained_tokens`` (run in its venv on the same saved model,
tokenizer and rows): an int setting (detection alone), a list, tied embeddings, nothing seen, untrained tokens only
in the middle rows, a chat template naming one, a tokenizer longer than the embedding; frozen embeddings raise
ConfigError here, where Axolotl's own check never fires."""

import json
import random

import pytest
import torch

from nd_parallel.config import ConfigError
from nd_parallel.models.untrained_tokens import fix_untrained_tokens
from tests.unit.axolotl_venv import run_in_axolotl

# Runs in Axolotl's interpreter, which cannot import our tests: each case on a freshly loaded model.
AXOLOTL_SCRIPT = """
import json, sys
import datasets, transformers
from axolotl.contribs.lgpl import fix_untrained_tokens
out = {}
for case in json.load(open(sys.argv[1])):
    model = transformers.AutoModelForCausalLM.from_pretrained(case["model"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(case["tokenizer"])
    if case["frozen"]:
        model.get_input_embeddings().weight.requires_grad_(False)
        model.get_output_embeddings().weight.requires_grad_(False)
    kwargs = {} if case["token_ids"] is None else {"token_ids_to_fix": case["token_ids"]}
    error = None
    try:
        fix_untrained_tokens(model, tokenizer, datasets.Dataset.from_dict({"input_ids": case["rows"]}), **kwargs)
    except ValueError as e:
        error = str(e)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    out[case["name"]] = {"error": error, "embed": embed.tolist(), "head": head.tolist(),
                         "requires_grad": [embed.requires_grad, head.requires_grad], "same_param": embed is head}
print(json.dumps(out))
"""
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
NAMES = ["<pad>", "<unk>", "<s>", "<|im_end|>", "<|im_start|>"]  # ids 0..4; 3 and 4 are in the template
ZERO = [0, 10, 11, 12, 62, 63]  # zero rows on both sides (0 is the pad token; 62, 63 are past a 60-token tokenizer)


def _tokenizer(path, size):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(NAMES + [f"w{i}" for i in range(len(NAMES), size)])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                  chat_template=TEMPLATE)
    assert len(tok) == size
    tok.save_pretrained(path)
    return str(path)


def _model(path, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied))
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        embed[ZERO] = 0
        head[ZERO] = 0
        if not tied:
            embed[[13, 14, 15]] = 0  # untrained on the input side; lm_head rows 13 and 14 repeat, 15 is unique
            head[14] = head[13]
            embed[16] = -embed[16].abs() - 0.1  # all negative: its maximum is below eps (not its absolute maximum)
            head[16] = -head[16].abs() - 0.1
    model.save_pretrained(path)
    return str(path)


def _rows(n, extra=None, length=6, seed=0):
    """n rows of trained ids (20..59), with ``extra[row]`` ids appended to those rows."""
    rng = random.Random(seed)
    rows = [[rng.randrange(20, 60) for _ in range(length)] for _ in range(n)]
    for row, ids in (extra or {}).items():
        rows[row] += ids
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("untrained")
    models = {"untied": _model(tmp / "untied", False), "tied": _model(tmp / "tied", True)}
    toks = {60: _tokenizer(tmp / "tok60", 60), 70: _tokenizer(tmp / "tok70", 70)}
    seen = {0: [10, 10, 0, 13], 5: [10, 11, 14], 40: [16, 15, 10], 299: [10]}
    cases = [  # name, model, tokenizer size, token_ids, frozen, rows, the ids changed
        ("int", "untied", 60, None, False, _rows(300, seen), [10, 11, 13, 14, 16]),
        # listed rows that are not zero, 45 and 50 past the set's first slots: the sums' order is not ascending
        ("list", "untied", 60, [22, 45, 20, 50, 10, 12, 21], False,
         _rows(300, {**seen, 7: [20, 21, 22, 22], 8: [22]}), [10, 11, 13, 14, 16, 20, 21, 22, 45, 50]),
        ("tied", "tied", 60, None, False, _rows(50, {3: [10, 10, 11], 9: [0, 10]}), [10, 11]),
        ("none_seen", "untied", 60, None, False, _rows(300, {4: [0, 15]}), []),
        ("middle_only", "untied", 60, None, False, _rows(600, {300: [10, 13]}), []),
        ("template", "untied", 60, [3], False, _rows(600, {300: [10, 3, 3]}), [3, 10]),
        ("long_tokenizer", "untied", 70, None, False, _rows(20, {1: [66] * 30, 2: [10, 11]}), [10, 11]),
        ("frozen", "untied", 60, None, True, _rows(300, seen), None),
    ]
    spec = [{"name": n, "model": models[m], "tokenizer": toks[t], "token_ids": ids, "frozen": frozen, "rows": rows}
            for n, m, t, ids, frozen, rows, _ in cases]
    (tmp / "spec.json").write_text(json.dumps(spec))
    (tmp / "axolotl_untrained.py").write_text(AXOLOTL_SCRIPT)
    theirs = run_in_axolotl(str(tmp / "axolotl_untrained.py"), str(tmp / "spec.json"))
    return {c["name"]: (c, changed) for c, (*_, changed) in zip(spec, cases)}, theirs


def _ours(case, frozen=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(case["model"])
    tokenizer = AutoTokenizer.from_pretrained(case["tokenizer"])
    if case["frozen"] if frozen is None else frozen:
        model.get_input_embeddings().weight.requires_grad_(False)
        model.get_output_embeddings().weight.requires_grad_(False)
    before = model.get_input_embeddings().weight.detach().clone(), model.get_output_embeddings().weight.detach().clone()
    return model, fix_untrained_tokens(model, tokenizer, iter(case["rows"]), token_ids=case["token_ids"]), before


def _same_rows(model, dump):
    # Exactly equal: the same float32 sums in the same order, the same float64 scaling, rounded once to float32.
    torch.testing.assert_close(model.get_input_embeddings().weight.detach(), torch.tensor(dump["embed"]),
                               rtol=0, atol=0)
    torch.testing.assert_close(model.get_output_embeddings().weight.detach(), torch.tensor(dump["head"]),
                               rtol=0, atol=0)


@pytest.mark.parametrize("name", ["int", "list", "tied", "none_seen", "middle_only", "template", "long_tokenizer"])
def test_rows_equal_axolotls(setup, name):
    cases, theirs = setup
    (case, changed), dump = cases[name], theirs[name]
    assert dump["error"] is None
    model, ours, (embed0, head0) = _ours(case)
    assert ours == changed
    _same_rows(model, dump)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    rest = [i for i in range(64) if i not in changed]
    assert torch.equal(embed[rest], embed0[rest]) and torch.equal(head[rest], head0[rest])
    if changed:
        assert not torch.equal(embed[changed], embed0[changed])
    if name == "tied":  # ours keeps the one Parameter; Axolotl's re-wrapping leaves two over the same storage
        assert embed is head and not dump["same_param"]
    assert embed.requires_grad and head.requires_grad


def test_frozen_embeddings_raise_where_axolotl_does_not(setup):
    """Ours raises ConfigError naming the ids; Axolotl 0.19 means to raise ValueError, but it re-wraps the weights as
    new (trainable) Parameters before its check, so it changes the rows as if they were trainable and leaves
    embed_tokens and lm_head trainable."""
    cases, theirs = setup
    (case, _), dump = cases["frozen"], theirs["frozen"]
    with pytest.raises(ConfigError, match=r"\[10, 11, 13, 14, 16\].*lora_modules_to_save") as err:
        _ours(case)
    assert isinstance(err.value, ValueError)
    model, ours, _ = _ours(case, frozen=False)
    assert dump["error"] is None and dump["requires_grad"] == [True, True]
    assert ours == [10, 11, 13, 14, 16]
    _same_rows(model, dump)


def test_frozen_checks_2000_rows_when_only_the_template_names_a_token(setup):
    cases, _ = setup
    case = {**cases["template"][0], "frozen": True}
    with pytest.raises(ConfigError, match=r"\[3\]"):
        _ours({**case, "rows": _rows(4500, {1500: [3]}, length=2)})  # in the first 2000 rows
    model, ours, (embed0, _) = _ours({**case, "rows": _rows(4500, {2200: [3, 10]}, length=2)})
    assert ours == [] and torch.equal(model.get_input_embeddings().weight, embed0)  # taken for a false signal


def test_wrong_ids_raise(setup):
    cases, _ = setup
    case = cases["int"][0]
    with pytest.raises(ConfigError, match=r"\[64, -1\] are not rows"):
        _ours({**case, "token_ids": [64, -1]})
    _ours({**case, "rows": case["rows"] + [[63]]})  # 60 tokens but 64 rows: ids up to 63 are counted
    with pytest.raises(ConfigError, match=r"\[64\] outside 0..63"):
        _ours({**case, "rows": case["rows"] + [[64]]})
