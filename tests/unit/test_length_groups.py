"""group_by_length's order (cli/train/sampling.py): transformers' length-grouped indices over megabatches of global
batches, seeded by (seed, epoch): the same for every layout and after a resume, sorted within each megabatch."""

import torch

from nd_parallel.cli.train.sampling import _EpochSeeded


def test_megabatches_are_sorted_and_seeded_by_epoch():
    lengths = torch.randint(3, 200, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    sampler = _EpochSeeded(8, lengths, seed=5)  # global batch 8: 96 // (8 * 4) = 3 batches per megabatch
    order = list(sampler)
    assert sorted(order) == list(range(96)) and lengths[order[0]] == max(lengths)
    for start in range(0, 96, 24):
        block = [lengths[i] for i in order[start:start + 24]]
        assert block[1:] == sorted(block[1:], reverse=True)  # the longest sample was swapped to the very front
    assert list(_EpochSeeded(8, lengths, seed=5)) == order  # every rank, and a restarted run
    sampler.set_epoch(1)
    assert list(sampler) != order
    again = _EpochSeeded(8, lengths, seed=5)
    again.set_epoch(1)
    assert list(again) == list(sampler)


def test_streamed_data_is_refused_and_packing_keeps_its_order(tmp_path):
    import json

    import pytest

    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.config import ConfigError

    path = tmp_path / "c.yml"
    base = {"base_model": "./m", "datasets": [{"path": "./d.jsonl", "type": "completion"}], "group_by_length": True}
    path.write_text(json.dumps({**base, "streaming": True, "max_steps": 2}))
    with pytest.raises(ConfigError, match="group_by_length with a streamed dataset"):
        load_train_config(path, environ={})
    path.write_text(json.dumps({**base, "sample_packing": True}))
    assert any("group_by_length with sample_packing: not grouped" in n
               for n in load_train_config(path, environ={}).notes)
    path.write_text(json.dumps(base))
    assert any("megabatches of" in n for n in load_train_config(path, environ={}).notes)
