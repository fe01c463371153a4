"""`batch_flattening` (cli/train/data_options.py, data/collate.py) through `nd-parallel train`: each micro-batch as
one row of its samples (no padding, positions restarting per sample) under FSDP2, DDP and CP2 equals one process
(every loss, every saved tensor), and equals the same YAML padded (without the key): flattening changes the layout of
a batch, not its loss. Chat samples of different lengths, full fine-tuning. Tolerance: fp32 reduction order only:
loss rtol 1e-5, tensors atol 1e-5."""

import pytest

from tests.distributed.train_yaml_helpers import chat_entry, compare_runs, run_groups, write_model_and_data

BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=2e-3, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=160, val_set_size=0.0,
            batch_flattening=True)
GROUPS = {"dp": ({"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2}}, {"micro_batch_size": 4}),
          "cp": ({"cp2": {"context_parallel_size": 2}}, {})}
CASES = [(group, layout) for group, (layouts, _) in GROUPS.items() for layout in layouts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flattening")
    data = write_model_and_data(root, n=48)
    row = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
           "datasets": [chat_entry(data["chat"])]}
    return run_groups(root, {"flat": row}, GROUPS, {"flat": {"batch_flattening": None}})


@pytest.mark.parametrize("group,layout", CASES)
def test_flattened_batches_match_one_process(runs, group, layout):
    compare_runs(runs / group / f"flat_{layout}", runs / group / "flat_ref", rtol=1e-5, atol=1e-5,
                 label=f"batch_flattening {layout}")


@pytest.mark.parametrize("group", list(GROUPS))
def test_flattening_keeps_the_padded_batchs_loss(runs, group):
    compare_runs(runs / group / "flat_ref", runs / group / "flat_plain", rtol=1e-5, atol=1e-5,
                 label=f"flattened vs padded ({group})")
