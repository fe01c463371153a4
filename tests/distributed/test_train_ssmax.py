"""scaling_softmax (SSMax, nd_parallel/models/ssmax.py; its logits equal Axolotl's own patch in
tests/unit/test_ssmax.py) through `nd-parallel train` with attn_implementation: flex_attention (SDPA on CPU ranks):
FSDP2, TP2 and PP2 equal one process (every loss, every saved tensor), unpacked and packed (each sample's own
positions), and SSMax changes the run (the same YAML without it ends elsewhere). Tolerance: fp32 reduction order."""

import pytest

from tests.distributed.train_yaml_helpers import compare_runs, run_groups, saved_tensors, write_model_and_data

BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=2e-3, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64, val_set_size=0.0,
            attn_implementation="flex_attention", scaling_softmax=True, scaling_softmax_factor=0.6,
            scaling_softmax_bias=0.1)
ROWS = {"ssmax": {}, "packed": {"sample_packing": True}}
OFF = {"scaling_softmax": None, "scaling_softmax_factor": None, "scaling_softmax_bias": None}
GROUPS = {"dp": ({"fsdp2": {"dp_shard_size": 2}}, {"micro_batch_size": 4}),
          "mp": ({"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}, {})}
CASES = [(row, group, layout) for row in ROWS for group, (layouts, _) in GROUPS.items() for layout in layouts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssmax")
    data = write_model_and_data(root, n=48)
    common = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "datasets": [{"path": data["text"], "type": "completion"}]}
    return run_groups(root, {row: {**common, **keys} for row, keys in ROWS.items()}, GROUPS, {row: OFF for row in ROWS})


@pytest.mark.parametrize("row,group,layout", CASES)
def test_ssmax_matches_one_process(runs, row, group, layout):
    compare_runs(runs / group / f"{row}_{layout}", runs / group / f"{row}_ref", rtol=1e-5, atol=1e-5,
                 label=f"ssmax {row} {layout}")


@pytest.mark.parametrize("row", list(ROWS))
def test_ssmax_changes_the_run(runs, row):
    got, plain = saved_tensors(runs / "dp" / f"{row}_ref"), saved_tensors(runs / "dp" / f"{row}_plain")
    assert max((got[k] - plain[k]).abs().max().item() for k in got) > 1e-5
