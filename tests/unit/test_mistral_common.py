"""Axolotl's `tokenizer_use_mistral_common: true`, read by `nd-parallel train` in one process (no ranks), on a tiny
tekken.json built here (nd_parallel.testing.tekken) next to a tiny Mistral: the tokens are mistral-common's own,
the labels train the assistant turns and their </s> (and equal Axolotl 0.19's, when its venv is there), the config
stage refuses what the tokenizer cannot honour, and a folder without the tokenizer file stops before any rank."""

import json
from pathlib import Path

import pytest

from nd_parallel.cli.train.config import TrainConfig, load_train_config
from nd_parallel.cli.train.data import load_prepared, mistral, prepare
from nd_parallel.cli.train.data.sources import DatasetSpec
from nd_parallel.config import ConfigError
from nd_parallel.testing.models import make_text, save_tiny_model
from nd_parallel.testing.tekken import write_tiny_tekken
from tests.unit.axolotl_venv import run_in_axolotl

pytest.importorskip("mistral_common")
LINES = make_text(40, seed=3)
SYSTEM = {"role": "system", "content": "be brief"}


def _chat(k: int, system: bool = True) -> list[dict]:
    turns = [{"role": r, "content": LINES[k + j]} for j, r in enumerate(("user", "assistant", "user", "assistant"))]
    return [SYSTEM, *turns] if system else turns


RECORDS = [{"messages": _chat(0)}, {"messages": _chat(4, system=False)}, {"messages": _chat(8)[:3]}]


def _checkpoint(folder: Path, version: str = "v7") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tekken(folder / "tekken.json", LINES, version=version)
    save_tiny_model("mistral", folder, seed=1, vocab_size=vocab, max_position_embeddings=512)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral_common")
    return {v: _checkpoint(root / v, v) for v in ("v3", "v7", "v13")}


def _tokenize(folder, records, **spec):
    tokenizer, _ = mistral.load_tokenizer(folder)
    train_on_inputs = spec.pop("train_on_inputs", False)
    fn = mistral.chat_fn(DatasetSpec(path="x", type="chat_template", **spec), tokenizer, "test",
                         train_on_inputs=train_on_inputs)
    out = fn({"messages": [r["messages"] for r in records]}, list(range(len(records))))
    return tokenizer, list(zip(out["input_ids"], out["labels"]))


def _trained_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([i for i, lab in zip(ids, labels) if lab != -100], skip_special_tokens=False)


@pytest.mark.parametrize("version", ["v3", "v7", "v13"])
def test_tokens_are_mistral_commons_own(models, version):
    """input_ids = mistral-common's MistralTokenizer.encode_chat_completion in fine-tuning mode, not through
    transformers."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    reference = MistralTokenizer.from_file(str(models[version] / "tekken.json"), mode=ValidationMode.finetuning)
    _, rows = _tokenize(models[version], RECORDS)
    for record, (ids, _) in zip(RECORDS, rows):
        request = ChatCompletionRequest.from_openai(messages=record["messages"])
        assert ids == reference.encode_chat_completion(request).tokens


@pytest.mark.parametrize("version", ["v3", "v7", "v13"])
def test_labels_train_the_assistant_turns_and_their_eos(models, version):
    """Default (roles_to_train [assistant], train_on_eos turn): exactly each answer + </s>, also where mistral-common
    before v7 moves the system prompt into the last user turn."""
    tokenizer, rows = _tokenize(models[version], RECORDS)
    for record, (ids, labels) in zip(RECORDS, rows):
        answers = [t["content"] for t in record["messages"] if t["role"] == "assistant"]
        assert _trained_text(tokenizer, ids, labels) == "".join(a + "</s>" for a in answers)
        assert labels[0] == -100 and labels[-1] == tokenizer.eos_token_id


def test_train_on_eos_options_and_train_on_inputs(models):
    tokenizer, rows = _tokenize(models["v7"], RECORDS[:1], train_on_eos="none")
    assert _trained_text(tokenizer, *rows[0]) == LINES[1] + LINES[3]
    tokenizer, rows = _tokenize(models["v7"], RECORDS[:1], train_on_eos="last")
    assert _trained_text(tokenizer, *rows[0]) == LINES[1] + LINES[3] + "</s>"
    tokenizer, rows = _tokenize(models["v7"], RECORDS[:1], roles_to_train=["user"], train_on_eos="none")
    assert _trained_text(tokenizer, *rows[0]) == LINES[0] + LINES[2]
    tokenizer, rows = _tokenize(models["v7"], RECORDS[:1], train_on_inputs=True)
    expected = "be brief" + LINES[0] + LINES[1] + "</s>" + LINES[2] + LINES[3] + "</s>"
    assert _trained_text(tokenizer, *rows[0]) == expected


@pytest.mark.parametrize("version", ["v7", "v13"])
def test_labels_equal_axolotls_mistral_strategy(models, version, tmp_path):
    """Axolotl 0.19's HFMistralTokenizer + MistralStrategy, run in its own venv on the same records and tekken.json:
    input_ids and labels equal for train_on_eos turn / last / none. (Axolotl finds turns on prefixes of the
    conversation; before v7 mistral-common moves the system prompt into the last user turn, so there its labels
    shift by that prompt: v3 is checked above against the answers themselves.)"""
    options = ["turn", "last", "none"]
    request = {"tekken": str(models[version] / "tekken.json"), "records": RECORDS, "options": options}
    (tmp_path / "request.json").write_text(json.dumps(request))
    theirs = run_in_axolotl(str(Path(__file__).with_name("axolotl_mistral_dump.py")), str(tmp_path / "request.json"))
    for option in options:
        ours = [list(map(list, row)) for row in _tokenize(models[version], RECORDS, train_on_eos=option)[1]]
        assert ours == theirs[option], option


def _yaml(tmp_path, extra: str, data_type: str = "chat_template") -> Path:
    path = tmp_path / "c.yml"
    path.write_text(f"base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: {data_type}\n{extra}")
    return path


def test_config_stage_accepts_the_key_and_refuses_what_it_cannot_honour(tmp_path):
    assert load_train_config(_yaml(tmp_path, "tokenizer_use_mistral_common: true\n"), environ={}) \
        .tokenizer_use_mistral_common is True
    extra = ("tokenizer_use_mistral_common: true\nchat_template: chatml\nspecial_tokens: {pad_token: '<pad>'}\n"
             "tokens: ['<x>']\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(_yaml(tmp_path, extra, data_type="alpaca"), environ={})
    message = str(err.value)
    for needle in ("chat_template='chatml' with tokenizer_use_mistral_common", "special_tokens=", "tokens=['<x>']",
                   "datasets[0].type='alpaca' with tokenizer_use_mistral_common"):
        assert needle in message, (needle, message)
    with pytest.raises(ConfigError, match="tokenizer_use_mistral_common='yes'; use true or false"):
        load_train_config(_yaml(tmp_path, "tokenizer_use_mistral_common: 'yes'\n"), environ={})


def test_magistral_names_turn_it_on_as_in_axolotl(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("base_model: ./Magistral-Small-2506\ndatasets:\n  - path: ./d.jsonl\n    type: chat_template\n")
    assert load_train_config(path, environ={}).tokenizer_use_mistral_common is True
    path.write_text(path.read_text() + "tokenizer_use_mistral_common: false\n")
    assert load_train_config(path, environ={}).tokenizer_use_mistral_common is False


def _cfg(model: Path, data: Path, **kw) -> TrainConfig:
    return TrainConfig(base_model=str(model), datasets=[DatasetSpec(path=str(data), type="chat_template")],
                       sequence_len=512, tokenizer_use_mistral_common=True, **kw)


def test_prepare_and_the_ranks_reload_the_mistral_common_tokenizer(models, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    prepared = prepare(_cfg(models["v7"], data, eot_tokens=["[/INST]"]), tmp_path / "work")
    assert prepared.tokenizer_how.startswith("mistral-common tokenizer") and prepared.train_rows == len(RECORDS)
    assert "eot_tokens ['[/INST]'] not read: </s> ends each assistant turn (as in Axolotl)" in prepared.tokenizer_how
    train, _, tokenizer = load_prepared(prepared.path)
    assert mistral.is_mistral(tokenizer) and tokenizer.pad_token_id is not None
    assert [list(r) for r in train["input_ids"]] == [ids for ids, _ in _tokenize(models["v7"], RECORDS)[1]]


def test_reasoning_chunks_are_rendered_and_trained_with_the_answer(models, tmp_path):
    """Magistral's dataset format (content chunks, {type: thinking}), read from a file: mistral-common renders the
    reasoning between [THINK] and [/THINK], trained with the answer. (Axolotl 0.19 joins a list content's text
    parts into one string first, which drops the thinking chunk: it trains the answer alone.)"""
    record = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": LINES[0]}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": LINES[1]},
                                          {"type": "text", "text": LINES[2]}]}]}
    data = tmp_path / "think.jsonl"
    data.write_text((json.dumps(record) + "\n") * 2)
    train, _, tokenizer = load_prepared(prepare(_cfg(models["v13"], data), tmp_path / "work").path)
    ids, labels = train[0]["input_ids"], train[0]["labels"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == \
        f"<s>[SYSTEM_PROMPT]be brief[/SYSTEM_PROMPT][INST]{LINES[0]}[/INST][THINK]{LINES[1]}[/THINK]{LINES[2]}</s>"
    assert _trained_text(tokenizer, ids, labels) == f"[THINK]{LINES[1]}[/THINK]{LINES[2]}</s>"


def test_a_folder_without_the_tokenizer_file_stops_before_any_rank(models, tmp_path):
    bare = tmp_path / "bare"
    save_tiny_model("mistral", bare, seed=1)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(ConfigError) as err:
        prepare(_cfg(bare, data), tmp_path / "work")
    assert f"{bare} has no mistral-common tokenizer file (tekken.json or tokenizer.model.v<N>)" in str(err.value)
    assert "point tokenizer_config at the folder that holds it" in str(err.value)


def test_sentencepiece_files_are_found_and_need_their_package(tmp_path):
    """tokenizer.model.v<N> (older Mistral checkpoints): the newest is chosen, tekken.json wins over it; reading
    it needs the sentencepiece package (named in the error where it is missing)."""
    import importlib.util

    for name in ("tokenizer.model.v3", "tokenizer.model.v11", "tokenizer.model"):
        (tmp_path / name).write_bytes(b"")
    assert mistral.tokenizer_file(tmp_path) == tmp_path / "tokenizer.model.v11"
    if importlib.util.find_spec("sentencepiece") is None:
        with pytest.raises(ConfigError, match="pip install sentencepiece"):
            mistral.load_tokenizer(tmp_path)
    (tmp_path / "tekken.json").write_text("{}")
    assert mistral.tokenizer_file(tmp_path) == tmp_path / "tekken.json"


def test_without_the_key_the_hf_tokenizer_stays_even_with_a_tekken_json(models, tmp_path):
    """transformers picks mistral-common for a Mistral folder with tekken.json once the package is installed;
    without the key nd-parallel train keeps reading the folder's Hugging Face tokenizer (and its template)."""
    import shutil

    from nd_parallel.cli.train.data.tokenizer import load_tokenizer
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    folder = tmp_path / "both"
    shutil.copytree(models["v7"], folder)
    train_tiny_tokenizer(LINES).save_pretrained(folder)
    tokenizer, how = load_tokenizer(TrainConfig(base_model=str(folder), datasets=[]))
    assert not mistral.is_mistral(tokenizer) and tokenizer.chat_template and how == f"tokenizer of {folder}"


def test_a_record_mistral_common_refuses_names_record_and_fix(models):
    bad = [{"messages": _chat(0)[:2]}]  # ends with a user turn: nothing to fine-tune on
    with pytest.raises(ConfigError, match=r"test, record 0: mistral-common refuses this conversation.*end with an "
                                          r"assistant turn"):
        _tokenize(models["v7"], bad)
