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
