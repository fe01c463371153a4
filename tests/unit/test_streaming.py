"""Axolotl's `pretraining_dataset`, `streaming: true` and `reinit_weights` in `nd-parallel train`, in one process:
the config mapping, the refusals (Axolotl's rules, one message), the streamed data read only as far as the run
needs, Axolotl's pretraining windows, and the seeded random init that reads no weight file."""

import json

import pytest
import torch

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.data import load_prepared, prepare
from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import write_model_and_data, write_yaml

RECORDS = 2000


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    out = write_model_and_data(root, n=40)
    lines = [json.loads(x)["text"] for x in open(out["text"])]
    # a corpus far larger than the runs below need: record i says which it is (the tiny BPE knows digits? use words)
    (root / "big.jsonl").write_text("".join(json.dumps({"body": f"{lines[i % 40]} {lines[(i * 7) % 40]}", "i": i})
                                            + "\n" for i in range(RECORDS)))
    out["big"] = str(root / "big.jsonl")
    return out


def _load(tmp_path, data, **keys):
    cfg = {"base_model": data["model"], "sequence_len": 64, "micro_batch_size": 2, "max_steps": 3,
           "output_dir": str(tmp_path / "out"), **keys}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return load_train_config(write_yaml(tmp_path / "c.yml", cfg), environ={})


def _refused(tmp_path, data, **keys) -> str:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, data, **keys)
    return str(err.value)


def test_pretraining_dataset_is_the_one_streamed_entry(tmp_path, data):
    cfg = _load(tmp_path, data, pretraining_dataset=[{"path": data["big"], "name": "en", "type": "pretrain",
                                                      "text_column": "body", "split": "train", "skip": 5}],
                pretrain_multipack_buffer_size=64, sample_packing=True)
    assert cfg.streaming and len(cfg.datasets) == 1
    spec = cfg.datasets[0]
    assert (spec.type, spec.field, spec.name, spec.skip, spec.split) == ("pretraining", "body", "en", 5, "train")
    assert cfg.streaming_multipack_buffer_size == 64  # the older name, moved
    assert cfg.pretraining_dataset == [{"path": data["big"], "name": "en", "type": "pretrain", "text_column": "body",
                                        "split": "train", "skip": 5}]
    plain = _load(tmp_path, data, pretraining_dataset=data["big"], num_epochs=4)  # Axolotl's string form
    assert plain.datasets[0].path == data["big"] and plain.datasets[0].field == "text"
    assert any("num_epochs=4: a stream runs for max_steps" in n for n in plain.notes), plain.notes


def test_streaming_and_reinit_keys_are_read(tmp_path, data):
    cfg = _load(tmp_path, data, datasets=[{"path": data["alpaca"], "type": "alpaca"}], streaming=True,
                reinit_weights=True, num_epochs=3)
    assert cfg.streaming and cfg.reinit_weights and cfg.datasets[0].type == "alpaca"
    assert any("a stream runs for max_steps" in n for n in cfg.notes), cfg.notes
    assert any("reinit_weights: the model starts from its config's own random init" in n for n in cfg.notes)


def test_streaming_refusals_in_one_message(tmp_path, data):
    """Axolotl's rules (max_steps, val_set_size, deduplication) and what a stream cannot give, each with its fix."""
    message = _refused(tmp_path, data, max_steps=None, val_set_size=0.1, dataset_exact_deduplication=True,
                       streaming=True, datasets=[{"path": data["text"]}, {"path": data["alpaca"], "type": "alpaca",
                                                                          "split": "train[:10]"}])
    assert "5 setting(s) cannot be used" in message, message
    for needle in ("streaming: true without max_steps", "val_set_size with streaming: true",
                   "dataset_exact_deduplication with streaming", "with 2 datasets entries",
                   "a slice needs the row count"):
        assert needle in message, (needle, message)


def test_pretraining_dataset_refusals(tmp_path, data):
    message = _refused(tmp_path, data, datasets=[{"path": data["text"]}],
                       pretraining_dataset=[{"path": "allenai/c4", "textcolumn": "t", "type": "alpaca"},
                                            {"path": "b"}])
    for needle in ("Axolotl streams only the first", "pretraining_dataset together with datasets",
                   "unknown key 'textcolumn' in pretraining_dataset[0]; did you mean 'text_column'?",
                   "pretraining_dataset[0].type='alpaca'"):
        assert needle in message, (needle, message)
    message = _refused(tmp_path, data, datasets=[{"path": data["text"], "skip": 3}], reinit_weights=True,
                       load_in_4bit=True, adapter="qlora")
    assert "datasets[0].skip: only a streamed dataset" in message and "reinit_weights with a quantized base" in message


def _prepared(tmp_path, data, dp=1, **keys):
    cfg = _load(tmp_path, data, **keys)
    prepared = prepare(cfg, tmp_path / "work", dp=dp)
    train, evals, _ = load_prepared(prepared.path)
    return cfg, prepared, train


def test_stream_reads_only_what_the_run_needs(tmp_path, data):
    """max_steps 3 x micro 2 x accumulation 2 x dp 2 = 24 packed rows, from a few chunks of 32 records of 2000."""
    cfg, prepared, train = _prepared(tmp_path, data, dp=2, gradient_accumulation_steps=2, sample_packing=True,
                                     streaming_multipack_buffer_size=32,
                                     pretraining_dataset=[{"path": data["big"], "text_column": "body"}])
    assert prepared.train_rows == len(train) == 24 and prepared.eval_rows == 0
    read = int(prepared.sources[0].split(": ")[1].split(" records read")[0])
    assert read % 32 == 0 and read < 300, prepared.sources  # whole chunks, far from the 2000 records
    assert "position_ids" in train.column_names and max(len(r) for r in train["input_ids"]) <= 64


def test_skip_and_shuffle_buffer(tmp_path, data):
    """skip leaves out the stream's first records; without shuffling the rows follow the file's order."""
    keys = dict(shuffle_merged_datasets=False, streaming_multipack_buffer_size=4, max_steps=1)
    _, _, first = _prepared(tmp_path / "a", data, pretraining_dataset=[{"path": data["big"], "text_column": "body"}],
                            **keys)
    _, _, skipped = _prepared(tmp_path / "b", data, **keys,
                              pretraining_dataset=[{"path": data["big"], "text_column": "body", "skip": 1}])
    assert first["input_ids"][1] == skipped["input_ids"][0]  # unpacked: one text per row
    _, _, shuffled = _prepared(tmp_path / "c", data, streaming_multipack_buffer_size=64, max_steps=1,
                               pretraining_dataset=[{"path": data["big"], "text_column": "body"}])
    assert shuffled["input_ids"] != first["input_ids"]


def test_pretraining_windows_are_axolotls(tmp_path, data):
    """Packed: a long text becomes windows of sequence_len - 1 tokens overlapping by (sequence_len - 1) // 2, each +
    EOS (Axolotl's PretrainTokenizationStrategy); unpacked: the text cut to sequence_len - 2 tokens, no EOS (its
    encode_streaming without concatenation), + EOS with pretraining_sample_concatenation."""
    from transformers import AutoTokenizer

    long = tmp_path / "long.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    text = " ".join(json.loads(x)["text"] for x in open(data["text"]))
    long.write_text(json.dumps({"text": text}) + "\n")
    ids = tokenizer(text)["input_ids"]
    L, stride = 32, 15
    _, _, packed = _prepared(tmp_path / "p", data, sequence_len=L, max_steps=1, micro_batch_size=1,
                             sample_packing=True, shuffle_merged_datasets=False,
                             pretraining_dataset=[{"path": str(long)}])
    row, eos = packed[0], tokenizer.eos_token_id
    assert row["input_ids"][:L - 1] == ids[:L - 1] and row["input_ids"][L - 1] == eos  # one window fills a row
    assert row["labels"][0] == -100 and row["labels"][1:] == row["input_ids"][1:]
    second = packed.to_list() if len(packed) > 1 else None
    assert second is None  # max_steps 1 x micro 1: one row is read
    _, _, two = _prepared(tmp_path / "p2", data, sequence_len=L, max_steps=2, micro_batch_size=1,
                          sample_packing=True, shuffle_merged_datasets=False, pretraining_dataset=[{"path": str(long)}])
    assert two[1]["input_ids"][:L - 1] == ids[L - 1 - stride:2 * (L - 1) - stride]  # the overlap
    _, _, cut = _prepared(tmp_path / "u", data, sequence_len=L, max_steps=1, micro_batch_size=1,
                          pretraining_dataset=[{"path": str(long)}])
    assert cut[0]["input_ids"] == ids[:L - 2] and "position_ids" not in cut.column_names
    _, _, joined = _prepared(tmp_path / "c", data, sequence_len=L, max_steps=1, micro_batch_size=1,
                             pretraining_sample_concatenation=True, pretraining_dataset=[{"path": str(long)}])
    assert joined[0]["input_ids"] == ids[:L - 2] + [eos]


def test_streamed_sft_is_tokenized_as_files_are(tmp_path, data):
    """streaming: true on an alpaca file: the same samples as the local path, in the file's order (no shuffle)."""
    keys = dict(datasets=[{"path": data["alpaca"], "type": "alpaca"}], shuffle_merged_datasets=False, max_steps=2,
                sequence_len=200)
    _, prepared, streamed = _prepared(tmp_path / "s", data, streaming=True, **keys)
    _, _, local = _prepared(tmp_path / "l", data, **keys)
    assert len(streamed) == 4 and "streamed" in prepared.sources[0]
    assert streamed["input_ids"] == local["input_ids"][:4] and streamed["labels"] == local["labels"][:4]


def test_a_missing_file_and_an_empty_stream_are_named(tmp_path, data):
    cfg = _load(tmp_path, data, pretraining_dataset=[{"path": str(tmp_path / "nope.jsonl")}])
    with pytest.raises(ConfigError, match="nope.jsonl' does not exist"):
        prepare(cfg, tmp_path / "work")
    cfg = _load(tmp_path, data, datasets=[{"path": data["alpaca"], "type": "alpaca"}], streaming=True, sequence_len=8)
    with pytest.raises(ConfigError, match="none of the 40 records read is left after tokenizing"):
        prepare(cfg, tmp_path / "work")


def test_a_stream_that_fails_says_why_not_that_nothing_was_left(tmp_path, data, monkeypatch):
    """A failure inside the stream (a network error of a hub stream, a tokenizer error) is reported as itself."""
    from nd_parallel.cli.train.data import streamed

    def broken(*args):
        def fn(batch, indices):
            raise OSError("connection reset by peer")
        return fn

    monkeypatch.setattr(streamed, "_record_fn", broken)
    cfg = _load(tmp_path, data, datasets=[{"path": data["alpaca"], "type": "alpaca"}], streaming=True)
    with pytest.raises(ConfigError, match="reading the stream failed after 0 records: OSError: connection reset"):
        prepare(cfg, tmp_path / "work")


def test_reinit_weights_is_the_seeded_init_and_reads_no_weights(tmp_path, data, monkeypatch):
    from transformers import AutoModelForCausalLM

    from nd_parallel.cli.train import rank
    from nd_parallel.models.loading import lazy_checkpoint

    cfg = _load(tmp_path, data, datasets=[{"path": data["text"]}], reinit_weights=True, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(data["model"])

    def no_weights(*args, **kwargs):
        raise AssertionError("reinit_weights read the checkpoint's weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    tokenizer = load_prepared(prepare(cfg, tmp_path / "work").path)[2]
    a, b = rank._model(cfg, tokenizer), rank._model(cfg, tokenizer)
    assert lazy_checkpoint(a) is None
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert x.dtype == torch.float32 and torch.equal(x, y), name  # seeded: the same on every rank
    ref = dict(loaded.named_parameters())
    assert not torch.equal(a.get_parameter("model.layers.0.mlp.up_proj.weight"),
                           ref["model.layers.0.mlp.up_proj.weight"])


def test_a_hub_name_is_opened_as_axolotl_opens_it(monkeypatch):
    """Not a local path: datasets.load_dataset(path, name=, split=, data_files=, streaming=True), as Axolotl's
    _load_streaming_dataset calls it (no hub here: the call is recorded)."""
    import datasets

    from nd_parallel.cli.train.data.sources import DatasetSpec, open_stream

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or "stream")
    stream, where = open_stream(DatasetSpec(path="allenai/c4", type="pretraining", name="en", split="train"))
    assert stream == "stream" and calls == [(("allenai/c4",), {"name": "en", "split": "train", "data_files": None,
                                                               "streaming": True})]
    assert where == "allenai/c4 (en, train, streamed)"

    def offline(*a, **k):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match="cannot stream the dataset 'allenai/c4' .*offline; check the hub name"):
        open_stream(DatasetSpec(path="allenai/c4", name="en"))
