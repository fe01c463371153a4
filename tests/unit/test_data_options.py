"""excess_length_strategy and dataset_shard_num / dataset_shard_idx (cli/train/data_options.py), with Axolotl's
meaning: long samples dropped, truncated or refused (with min_sample_len either way); one contiguous shard kept."""

import json
from types import SimpleNamespace

import datasets
import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.data_options import length_filter, shard
from nd_parallel.config import ConfigError


def _rows():
    lengths = [1, 3, 5, 8, 12]
    return datasets.Dataset.from_dict({"input_ids": [list(range(n)) for n in lengths],
                                       "labels": [list(range(n)) for n in lengths]})


def test_long_samples_are_dropped_truncated_or_refused():
    cfg = SimpleNamespace(min_sample_len=2, sequence_len=6, excess_length_strategy=None)
    assert [len(r) for r in length_filter(_rows(), cfg, "d")["input_ids"]] == [3, 5]
    cfg.excess_length_strategy = "truncate"
    kept = length_filter(_rows(), cfg, "d")
    assert [len(r) for r in kept["input_ids"]] == [3, 5, 6, 6] and kept["labels"][3] == list(range(6))
    cfg.excess_length_strategy = "raise"
    with pytest.raises(ConfigError, match="2 sample\\(s\\) are longer than sequence_len=6"):
        length_filter(_rows(), cfg, "d")


def test_one_contiguous_shard_is_kept():
    ds = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(10)]})
    kept, line = shard(ds, SimpleNamespace(dataset_shard_num=3, dataset_shard_idx=1))
    assert kept["input_ids"] == [[4], [5], [6]] and "3 of 10 samples kept" in line
    assert shard(ds, SimpleNamespace(dataset_shard_num=None, dataset_shard_idx=None)) == (ds, None)


def test_config_stage(tmp_path):
    base = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
    (tmp_path / "c.yml").write_text(json.dumps({**base, "excess_length_strategy": "Truncate",
                                                "dataset_shard_num": 4, "dataset_shard_idx": 3}))
    cfg = load_train_config(tmp_path / "c.yml", environ={})
    assert cfg.excess_length_strategy == "truncate" and cfg.dataset_shard_num == 4
    (tmp_path / "c.yml").write_text(json.dumps({**base, "excess_length_strategy": "cut", "dataset_shard_num": 2,
                                                "dataset_shard_idx": 2, "rl": "dpo"}))
    with pytest.raises(ConfigError) as err:
        load_train_config(tmp_path / "c.yml", environ={})
    for needle in ("excess_length_strategy='cut'", "dataset_shard_idx=2: write both", "dataset_shard_num with rl"):
        assert needle in str(err.value), (needle, str(err.value))


def test_auto_resume_is_resume_from_checkpoint_auto(tmp_path):
    base = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}],
            "auto_resume_from_checkpoints": True}
    (tmp_path / "c.yml").write_text(json.dumps(base))
    assert load_train_config(tmp_path / "c.yml", environ={}).resume_from_checkpoint == "auto"
    (tmp_path / "c.yml").write_text(json.dumps({**base, "resume_from_checkpoint": str(tmp_path)}))
    assert load_train_config(tmp_path / "c.yml", environ={}).resume_from_checkpoint == str(tmp_path)  # given wins


def test_pad_to_multiple_of_pads_as_axolotls_collator_and_changes_no_loss(tmp_path):
    """Axolotl's collator: the longest row rounded up to the multiple, or sequence_len rounded up with
    pad_to_sequence_len / packing. The padding is masked: the tiny model's loss is the same padded or not."""
    import torch

    from nd_parallel.cli.train.data.collate import Collator
    from nd_parallel.cli.train.data_options import padding
    from nd_parallel.testing.models import save_tiny_model

    t = SimpleNamespace(pad_to_multiple_of=16, sequence_len=100, pad_to_sequence_len=False, sample_packing=False)
    assert padding(t) == (None, 16)
    t.pad_to_sequence_len = True
    assert padding(t) == (112, 16)
    t.pad_to_multiple_of = None
    assert padding(t) == (100, None)
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9]}, {"input_ids": [3, 4, 5], "labels": [-100, 4, 5]}]
    from nd_parallel.cli.train.data_options import collator  # what the ranks build

    plain = Collator(0)(rows)
    padded = collator(SimpleNamespace(pad_to_multiple_of=16, sequence_len=100, pad_to_sequence_len=False,
                                      sample_packing=False, batch_flattening=None), 0)(rows)
    assert plain["input_ids"].shape == (2, 5) and padded["input_ids"].shape == (2, 16)
    assert padded["attention_mask"][1].tolist() == [1] * 3 + [0] * 13 and (padded["labels"][:, 5:] == -100).all()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model("llama", tmp_path / "m", seed=0), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(**padded).loss, model(**plain).loss, rtol=1e-6, atol=0)


def test_pad_to_multiple_of_config(tmp_path):
    base = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
    (tmp_path / "c.yml").write_text(json.dumps({**base, "pad_to_multiple_of": 0}))
    with pytest.raises(ConfigError, match="pad_to_multiple_of=0: write an integer >= 1"):
        load_train_config(tmp_path / "c.yml", environ={})
    dpo = {"datasets": [{"path": "d.jsonl", "type": "chatml.intel"}], "rl": "dpo"}
    (tmp_path / "c.yml").write_text(json.dumps({**base, "pad_to_multiple_of": 8, **dpo}))
    cfg = load_train_config(tmp_path / "c.yml", environ={})
    assert any(n.startswith("pad_to_multiple_of: these batches are laid out by TRL") for n in cfg.notes), cfg.notes


def test_test_datasets_are_the_evaluation_data(tmp_path):
    """test_datasets: prepared like datasets (tokenized, filtered by eval_sequence_len instead of sequence_len) as
    the evaluation rows; refused with val_set_size (Axolotl's rule) and with a bad entry, named as test_datasets."""
    from nd_parallel.cli.train.data import load_prepared, prepare
    from tests.distributed.train_yaml_helpers import write_model_and_data, write_yaml

    data = write_model_and_data(tmp_path, n=24)
    base = {"base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}],
            "sequence_len": 256, "output_dir": str(tmp_path / "o")}

    def prepared(name, **keys):
        cfg = load_train_config(write_yaml(tmp_path / f"{name}.yml", {**base, **keys}), environ={})
        return prepare(cfg, tmp_path / name)

    wide = prepared("wide", test_datasets=[{"path": data["alpaca"], "type": "alpaca"}])
    narrow = prepared("narrow", test_datasets=[{"path": data["alpaca"], "type": "alpaca"}], eval_sequence_len=180)
    assert wide.train_rows == 24 and 0 < narrow.eval_rows < wide.eval_rows <= 24, (wide, narrow)
    assert any(line.startswith("test_datasets: ") for line in wide.sources)
    train, evals, _ = load_prepared(narrow.path)
    assert len(train) == 24 and max(len(r) for r in evals["input_ids"]) <= 180
    with pytest.raises(ConfigError, match="test_datasets with val_set_size=0.1: the evaluation data is one or"):
        prepared("v", test_datasets=[{"path": data["alpaca"], "type": "alpaca"}], val_set_size=0.1)
    with pytest.raises(ConfigError, match=r"test_datasets\[0\]"):
        prepared("bad", test_datasets=[{"type": "alpaca"}])
    cfg = load_train_config(write_yaml(tmp_path / "n.yml", {**base, "eval_sequence_len": 60}), environ={})
    assert any(n.startswith("eval_sequence_len without test_datasets") for n in cfg.notes)


def test_batch_flattening_lays_a_batch_out_as_one_row(tmp_path):
    """DataCollatorWithFlattening's layout: samples back to back, positions restarting, each sample's first label
    masked; Axolotl's rules (not with sample_packing unless auto), and not under PP (one row cannot be split)."""
    from nd_parallel.cli.train.data.collate import Collator
    from nd_parallel.cli.train.data_options import flattens

    rows = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]
    flat = Collator(0, flatten=True)(rows)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and flat["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert flat["labels"].tolist() == [[-100, 6, 7, -100, 9]] and "attention_mask" not in flat
    assert flattens(SimpleNamespace(batch_flattening="auto", sample_packing=False))
    assert not flattens(SimpleNamespace(batch_flattening="auto", sample_packing=True))
    from nd_parallel.cli.train.data_options import collator  # what the ranks build

    keys = dict(pad_to_multiple_of=None, sequence_len=64, pad_to_sequence_len=False, sample_packing=False)
    assert collator(SimpleNamespace(batch_flattening=True, **keys), 0)(rows)["input_ids"].shape == (1, 5)
    assert collator(SimpleNamespace(batch_flattening=None, **keys), 0)(rows)["input_ids"].shape == (2, 3)
    base = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}], "batch_flattening": True}
    for keys, match in (({"sample_packing": True}, "batch_flattening with sample_packing"),
                        ({"pipeline_parallel_size": 2}, "the pipeline splits a micro-batch into rows"),
                        ({"batch_flattening": "yes"}, "write true, false or auto")):
        (tmp_path / "c.yml").write_text(json.dumps({**base, **keys}))
        with pytest.raises(ConfigError, match=match):
            load_train_config(tmp_path / "c.yml", environ={})
