"""PoSE (cli/train/pose.py): the position ids equal Axolotl 0.19's add_pose_position_ids on the same random state
(run in its venv), each sample's are keyed by (seed, index), the prepared data carries them (also packed), and the
config stage's refusals."""

import json
import random

import pytest

from nd_parallel.cli.train.config import load_train_config
from nd_parallel.cli.train.pose import add_pose_position_ids
from nd_parallel.config import ConfigError
from tests.distributed.train_yaml_helpers import write_model_and_data, write_yaml
from tests.unit.axolotl_venv import run_in_axolotl

CASES = [  # input_ids, max_context_len, split_on_token_ids, chunks
    (list(range(10, 30)), 100, None, 2), (list(range(10, 40)), 64, None, 4), ([1, 5, 9, 5, 2, 2, 5, 7, 8, 5, 3], 50,
                                                                            [5], 2),
    ([5, 1, 2, 3, 5, 4], 6, [5], 2), (list(range(7)), 7, None, 3), (list(range(12)), 40, [99], 2)]

_AXOLOTL = """
import json, random, sys
from axolotl.utils.trainer import add_pose_position_ids
out = []
for seed, (ids, longest, split, chunks) in enumerate(json.loads(sys.argv[1])):
    random.seed(seed)
    sample = add_pose_position_ids({"input_ids": ids}, max_context_len=longest, split_on_token_ids=split, chunks=chunks)
    out.append(sample["position_ids"].tolist())
print(json.dumps(out))
"""


def test_positions_equal_axolotls_on_the_same_random_state():
    theirs = run_in_axolotl("-c", _AXOLOTL, json.dumps(CASES), timeout=600)
    for seed, ((ids, longest, split, chunks), want) in enumerate(zip(CASES, theirs)):
        got = add_pose_position_ids(ids, random.Random(seed), longest, split, chunks)
        assert got == want, (seed, got, want)
        assert got[0] == 0 and all(b > a for a, b in zip(got, got[1:])) and got[-1] < longest


def test_skips_only_before_split_tokens_and_within_the_context():
    ids = [7, 1, 2, 7, 3, 4, 5, 7, 6]
    for seed in range(50):
        got = add_pose_position_ids(ids, random.Random(seed), 30, [7])
        jumps = [i for i in range(1, len(ids)) if got[i] != got[i - 1] + 1]
        assert set(jumps) <= {3, 7} and got[-1] <= 29
    assert any(add_pose_position_ids(ids, random.Random(s), 30, [7])[-1] > 8 for s in range(5))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_model_and_data(tmp_path_factory.mktemp("pose"), n=24)


def _prepared(tmp_path, data, work="work", **keys):
    from nd_parallel.cli.train.data import load_prepared, prepare

    cfg = load_train_config(write_yaml(tmp_path / "c.yml", {
        "base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}], "sequence_len": 64,
        "use_pose": True, "pose_max_context_len": 256, "output_dir": str(tmp_path / "o"), **keys}), environ={})
    return load_prepared(prepare(cfg, tmp_path / work).path)[0]


def test_prepared_rows_carry_the_positions(tmp_path, data):
    rows = _prepared(tmp_path, data)
    ends = [r["position_ids"][-1] for r in rows]
    assert ends == sorted(ends) and max(ends) < 256 and any(e >= len(r["input_ids"]) for e, r in zip(ends, rows))
    assert all(r["position_ids"][0] == 0 and len(r["position_ids"]) == len(r["input_ids"]) for r in rows)
    assert _prepared(tmp_path, data, "again")["position_ids"] == rows["position_ids"]  # keyed: prepared afresh, same
    packed = _prepared(tmp_path, data, sample_packing=True, pose_num_chunks=3)
    starts = sum(p == 0 for r in packed for p in r["position_ids"])
    assert starts == len(rows) and len(packed) < len(rows)  # every sample one document of a packed row


@pytest.mark.parametrize("keys,match", [
    ({"use_pose": True}, "pose_max_context_len=None: write the context length"),
    ({"use_pose": True, "pose_max_context_len": 32, "sequence_len": 64}, "is below sequence_len=64"),
    ({"pose_max_context_len": 128}, "without use_pose: true"),
    ({"use_pose": True, "pose_max_context_len": 128, "pose_split_on_token_ids": "a"}, "write a list of token ids"),
])
def test_refusals(tmp_path, keys, match):
    cfg = {"base_model": "./m", "datasets": [{"path": "d.jsonl", "type": "completion"}], **keys}
    with pytest.raises(ConfigError, match=match):
        load_train_config(write_yaml(tmp_path / "c.yml", cfg), environ={})
