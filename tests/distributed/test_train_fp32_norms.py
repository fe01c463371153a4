"""fp32_norms (cli/train/norms.py) through `nd-parallel train` in bf16: FSDP2 and TP2 equal one process with the same
setting at the bf16 tolerance derived in test_train_modes.py (loss rtol 2**-8; bf16 keeps 8 significant bits), and
fp32 norms change the run (the same bf16 YAML without them ends elsewhere by more than that)."""

import pytest
import torch

from tests.distributed.train_yaml_helpers import logged, run_groups, write_model_and_data

BF16_U = 2.0 ** -8
BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=2e-3, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64, val_set_size=0.0, bf16=True,
            fp32_norms=True)
GROUPS = {"dp": ({"fsdp2": {"dp_shard_size": 2}}, {"micro_batch_size": 4}),
          "mp": ({"tp2": {"tensor_parallel_size": 2}}, {})}
CASES = [(group, layout) for group, (layouts, _) in GROUPS.items() for layout in layouts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp32_norms")
    data = write_model_and_data(root, n=48)
    row = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
           "datasets": [{"path": data["text"], "type": "completion"}]}
    return run_groups(root, {"norms": row}, GROUPS, {"norms": {"fp32_norms": None}})


def _losses(path):
    return torch.tensor([r["loss"] for r in logged(path)])


@pytest.mark.parametrize("group,layout", CASES)
def test_fp32_norms_match_one_process_in_bf16(runs, group, layout):
    got, ref = _losses(runs / group / f"norms_{layout}"), _losses(runs / group / "norms_ref")
    print(f"fp32_norms {layout}: losses {got.tolist()} max rel {((got - ref).abs() / ref).max():.2e}")
    torch.testing.assert_close(got, ref, rtol=BF16_U, atol=0)


def test_fp32_norms_change_the_bf16_run(runs):
    got, plain = _losses(runs / "dp" / "norms_ref"), _losses(runs / "dp" / "norms_plain")
    print(f"fp32 vs bf16 norms: max rel {((got - plain).abs() / plain).max():.2e}")
    assert ((got - plain).abs() / plain).max() > 1e-5, (got, plain)  # measured 9.5e-5: both are one process
