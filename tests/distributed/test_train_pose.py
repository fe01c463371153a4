"""PoSE (`use_pose`, cli/train/pose.py) through `nd-parallel train`: the samples' skipped position ids reach the
model under FSDP2 and context parallelism (the ring attention reads the positions; each sample stays one document),
unpacked and packed: every loss and saved tensor equal one process on the global batch, and the positions change
the run (the same YAML without use_pose ends elsewhere). Tolerance: fp32 reduction order only: loss rtol 1e-5,
tensors atol 1e-5."""

import pytest

from tests.distributed.train_yaml_helpers import compare_runs, run_groups, saved_tensors, write_model_and_data

BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=2e-3, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64, val_set_size=0.0, use_pose=True,
            pose_max_context_len=512, pad_to_sequence_len=True)
ROWS = {"pose": {}, "packed": {"sample_packing": True, "pose_num_chunks": 3}}
OFF = {"use_pose": None, "pose_max_context_len": None, "pose_num_chunks": None}
# FSDP2's global batch is 2 ranks x 2 rows (the reference takes 4 rows a step); CP's ranks split each row
GROUPS = {"dp": ({"fsdp2": {"dp_shard_size": 2}}, {"micro_batch_size": 4}),
          "cp": ({"cp2": {"context_parallel_size": 2}}, {})}
CASES = [(row, group, layout) for row in ROWS for group, (layouts, _) in GROUPS.items() for layout in layouts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pose")
    data = write_model_and_data(root, n=48)
    common = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "datasets": [{"path": data["text"], "type": "completion"}]}
    return run_groups(root, {row: {**common, **keys} for row, keys in ROWS.items()}, GROUPS, {row: OFF for row in ROWS})


@pytest.mark.parametrize("row,group,layout", CASES)
def test_pose_matches_one_process(runs, row, group, layout):
    compare_runs(runs / group / f"{row}_{layout}", runs / group / f"{row}_ref", rtol=1e-5, atol=1e-5,
                 label=f"pose {row} {layout}")


@pytest.mark.parametrize("row", list(ROWS))
def test_the_positions_change_the_run(runs, row):
    got, plain = saved_tensors(runs / "dp" / f"{row}_ref"), saved_tensors(runs / "dp" / f"{row}_plain")
    assert max((got[k] - plain[k]).abs().max().item() for k in got) > 1e-5
