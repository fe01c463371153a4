"""Axolotl's instruction record types (`alpaca:<style>`, `alpaca_chat`, `jeopardy`), `dataset_exact_deduplication`,
`eta_min` and `chat_template: gemma4_unified`, read by `nd-parallel train` in one process (no ranks): the same
tokens and labels as Axolotl 0.19's own strategies (when its venv is there), what each style writes, and the
refusals with their fix."""

import json
from pathlib import Path

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.data import instructions
from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import write_model_and_data, write_yaml
from tests.unit.axolotl_venv import run_in_axolotl


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("instruction_data")
    out = write_model_and_data(root, n=30)
    alpaca = json.loads(Path(out["alpaca"]).read_text())
    jeopardy = [{"question": r["instruction"], "category": r["input"], "answer": r["output"]} for r in alpaca]
    out["jeopardy"] = str(root / "jeopardy.json")
    Path(out["jeopardy"]).write_text(json.dumps(jeopardy))
    return out


def _tokenized(data, kind: str, style: str, train_on_inputs: bool, sequence_len: int = 1024):
    from transformers import AutoTokenizer

    from nd_parallel.cli.train.data.formats import tokenize_fn
    from nd_parallel.cli.train.data.sources import DatasetSpec

    records = json.loads(Path(data[kind]).read_text())
    fn = tokenize_fn(DatasetSpec(path=data[kind], type=f"{kind}:{style}"), AutoTokenizer.from_pretrained(
        data["model"]), "test", sequence_len=sequence_len, train_on_inputs=train_on_inputs)
    out = fn({k: [r.get(k) for r in records] for k in records[0]}, list(range(len(records))))
    return [[ids, labels] for ids, labels in zip(out["input_ids"], out["labels"])]


def test_instruction_types_tokenize_as_axolotl(data, tmp_path):
    """Axolotl 0.19's AlpacaPromptTokenizingStrategy / JeopardyPromptTokenizingStrategy, run in its own venv on the
    same records and tokenizer: input_ids and labels equal for every style, with and without train_on_inputs.
    (sequence_len is large: Axolotl cuts a long prompt before appending the response, and both then drop it.)"""
    request = {"model": data["model"], "len": 1024, **{k: json.loads(Path(data[k]).read_text())
                                                       for k in ("alpaca", "jeopardy")}}
    (tmp_path / "records.json").write_text(json.dumps(request))
    theirs = run_in_axolotl(str(Path(__file__).with_name("axolotl_prompt_dump.py")), str(tmp_path / "records.json"))
    assert len(theirs) == 16
    for key, rows in theirs.items():
        kind, style, train_on_inputs = key.split(":")
        assert _tokenized(data, kind, style, train_on_inputs == "True") == rows, key


@pytest.mark.parametrize("style,head,turn", [
    ("instruct", "Below is an instruction", "### Response:\n"),
    ("chat", "SYSTEM: Below is an instruction", "\nASSISTANT:"),
    ("chatml", "<|im_start|>system\nBelow is an instruction", "<|im_start|>assistant\n"),
    ("phi", "<|system|>\nBelow is an instruction", "<|assistant|>")])
def test_each_style_writes_its_prompt_and_trains_the_response(data, style, head, turn):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(data["model"])
    records = json.loads(Path(data["jeopardy"]).read_text())
    for (ids, labels), rec in zip(_tokenized(data, "jeopardy", style, False)[:4], records):
        text = tok.decode(ids)
        assert text.startswith(head) and turn in text, text
        prompt = instructions.prompt(style, rec["question"], rec["category"])
        assert text.startswith(prompt) and ("paired with an input" in text) == bool(rec["category"])
        trained = tok.decode([t for t, lab in zip(ids, labels) if lab != -100])
        assert trained == "what is " + rec["answer"] + tok.eos_token  # Jeopardy's answer, then EOS


def _config(tmp_path, data, entries, **keys):
    keys = {"base_model": data["model"], "datasets": entries, "sequence_len": 256, **keys}  # the model's limit
    return load_train_config(write_yaml(tmp_path / "c.yml", keys), environ={})


def test_instruction_types_pass_the_config_stage_and_bad_styles_are_refused(tmp_path, data):
    entries = [{"path": data["alpaca"], "type": t} for t in ("alpaca:chat", "alpaca:phi", "alpaca:chatml",
                                                            "alpaca:instruct", "alpaca_chat")]
    cfg = _config(tmp_path, data, entries + [{"path": data["jeopardy"], "type": "jeopardy"}])
    assert [instructions.parse(s.type) for s in cfg.datasets] == [
        ("alpaca", "chat"), ("alpaca", "phi"), ("alpaca", "chatml"), ("alpaca", "instruct"), ("alpaca", "chat"),
        ("jeopardy", "instruct")]
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, data, [{"path": data["alpaca"], "type": t} for t in ("alpaca:vicuna", "oasst")])
    message = str(err.value)
    assert "datasets[0].type='alpaca:vicuna' is not supported by nd-parallel train; use alpaca:<style> with one " \
           "of Axolotl's prompt styles (instruct, chat, chatml, phi)" in message, message
    assert "datasets[1].type='oasst'" in message and "alpaca:phi, alpaca_chat, jeopardy" in message, message


def test_a_jeopardy_record_without_its_category_is_named(tmp_path, data):
    from nd_parallel.cli.train.data import prepare

    (tmp_path / "j.json").write_text(json.dumps([{"question": "q", "answer": "a"}]))
    cfg = _config(tmp_path, data, [{"path": str(tmp_path / "j.json"), "type": "jeopardy"}])
    with pytest.raises(ConfigError, match=r"record 0: no 'category' field \(it has question, answer\); jeopardy "
                                          r"records need question, answer and category"):
        prepare(cfg, tmp_path / "work")


def test_exact_deduplication_drops_repeated_samples_before_the_split(tmp_path, data):
    from nd_parallel.cli.train.data import load_prepared, prepare

    twice = [{"path": data["alpaca"], "type": "alpaca"}] * 2
    plain = prepare(_config(tmp_path, data, twice, val_set_size=0.25), tmp_path / "w1")
    once = prepare(_config(tmp_path, data, twice, val_set_size=0.25, dataset_exact_deduplication=True), tmp_path / "w2")
    kept = (plain.train_rows + plain.eval_rows) // 2  # the samples of one copy within sequence_len
    assert kept > 10 and once.train_rows + once.eval_rows == kept
    assert f"dataset_exact_deduplication: {kept} duplicate sample(s) dropped, {kept} kept" in once.sources
    train, evals, _ = load_prepared(once.path)
    rows = [tuple(r["input_ids"]) for r in train] + [tuple(r["input_ids"]) for r in evals]
    assert len(set(rows)) == len(rows) == kept  # no sample is both trained on and held out
    with pytest.raises(ConfigError, match="dataset_exact_deduplication='yes'; use true or false"):
        _config(tmp_path, data, twice, dataset_exact_deduplication="yes")


def test_eta_min_is_accepted_as_axolotl_drops_it(tmp_path, data):
    cfg = _config(tmp_path, data, [{"path": data["alpaca"], "type": "alpaca"}], eta_min=7e-7, lr_scheduler="cosine")
    assert "eta_min" in cfg.unused and cfg.cosine_min_lr_ratio is None
    assert any(n.startswith("eta_min: not an Axolotl key: Axolotl drops it") for n in cfg.notes), cfg.notes


def test_gemma4_unified_is_the_gemma4_template():
    """Axolotl 0.19 ships gemma4_unified.jinja as a copy of gemma4.jinja: a text conversation renders the same."""
    from nd_parallel.cli.train.data.templates import FORMATS, jinja, template_problem

    assert template_problem("gemma4_unified") is None and jinja(FORMATS["gemma4_unified"]) == jinja(FORMATS["gemma4"])
    assert "renders images through a processor: set processor_type" in template_problem("llava")
    assert template_problem("llava", multimodal=True) is None


def test_pretokenized_records_are_used_as_they_are(tmp_path, data):
    """Axolotl's `type:` left empty: input_ids / labels taken as written (only the length filters apply)."""
    from nd_parallel.cli.train.data import load_prepared, prepare

    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "attention_mask": [1] * 4},
            {"input_ids": [9, 10, 11], "labels": [9, 10, 11]}, {"input_ids": [12], "labels": [12]}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(tmp_path, data, [{"path": str(tmp_path / "t.jsonl"), "type": None}])
    assert cfg.datasets[0].type == "tokenized"
    prepared = prepare(cfg, tmp_path / "work")
    train, _, _ = load_prepared(prepared.path)
    assert [r["input_ids"] for r in train] == [[5, 6, 7, 8], [9, 10, 11]]  # one token < min_sample_len: dropped
    assert [r["labels"] for r in train] == [[-100, -100, 7, 8], [9, 10, 11]]


@pytest.mark.parametrize("row,match", [
    ({"input_ids": [5, 6, 7], "labels": [5, 6]}, "input_ids and labels must be lists of the same length "
                                                 r"\(got 3 and 2\)"),
    ({"input_ids": [5, 6, 7]}, r"no 'labels' field \(it has input_ids\); pre-tokenized records"),
    ({"input_ids": [5, 6, 7], "labels": [5, 6, 7], "attention_mask": [1, 1, 0]},
     "attention_mask must be all ones over input_ids")])
def test_bad_pretokenized_records_are_named(tmp_path, data, row, match):
    from nd_parallel.cli.train.data import prepare

    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=r"t\.jsonl, record 0: " + match):
        prepare(_config(tmp_path, data, [{"path": str(tmp_path / "t.jsonl"), "type": None}]), tmp_path / "work")


def test_keys_of_newer_axolotl_examples_are_refused_with_their_reason(tmp_path, data):
    """Keys Axolotl's examples use that came after 0.19 and an rl value Axolotl does not have: one message, each with
    its reason (not the generic unknown-key list). Axolotl's fused kernels of the same math (use_glm_dsa_kernels,
    use_dsv4_kernels) are accepted with one line each, as its other kernel switches."""
    keys = dict(nvfp4_merge_aware=True, dsv4_fp4_grouped_mode="nvfp4", use_glm_dsa_kernels=True,
                llmcompressor={"recipe": {}}, rl="ppo", fp8=True, fp8_enable_fsdp_float8_all_gather=True)
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, data, [{"path": data["alpaca"], "type": "alpaca"}], **keys)
    message = str(err.value)
    assert "7 setting(s) cannot be used" in message and "valid keys are" not in message, message
    for needle in ("pre-quantized NVFP4 checkpoints are not loaded", "FP4 grouped expert kernels",
                   "llmcompressor.recipe has no modifier",
                   "list axolotl.integrations.llm_compressor.LLMCompressorPlugin under plugins:",
                   "rl='ppo': nd-parallel train runs rl: dpo, ipo",
                   "fp8=True: FP8 training runs its matmuls on CUDA FP8 tensor cores", "train in bf16",
                   "fp8_enable_fsdp_float8_all_gather=True: belongs to fp8"):
        assert needle in message, (needle, message)
    assert "GLM DSA" not in message
    cfg = _config(tmp_path, data, [{"path": data["alpaca"], "type": "alpaca"}], use_glm_dsa_kernels=True,
                  use_dsv4_kernels=True)
    assert {n.split(":")[0] for n in cfg.notes} >= {"use_glm_dsa_kernels", "use_dsv4_kernels"}, cfg.notes


def test_pretraining_dataset_alone_is_one_line(tmp_path, data):
    """Axolotl's streamed pretraining_dataset without max_steps: Axolotl's refusal, not also 'give the data as'."""
    path = write_yaml(tmp_path / "c.yml", {"base_model": data["model"], "pretraining_dataset": [{"path": "x"}]})
    with pytest.raises(ConfigError) as err:
        load_train_config(path, environ={})
    message = str(err.value)
    assert "1 setting(s) cannot be used" in message and "pretraining_dataset without max_steps" in message, message
