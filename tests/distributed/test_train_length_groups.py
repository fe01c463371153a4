"""Axolotl's group_by_length through `nd-parallel train` (cli/train/sampling.py): alpaca samples of different
lengths, not packed, gradient accumulation 2; FSDP2 and DDP equal one process on the global batch (the megabatches
are made of global batches and seeded by seed and epoch), and grouping changes what the steps see (the same YAML
without it logs other losses).

Tolerance: the same samples meet in the same steps, so what differs is fp32 reduction order: loss rtol 1e-5,
saved tensors atol 1e-5 (full fine-tuning, AdamW epsilon 1e-6).
"""

import pytest

from tests.distributed.train_yaml_helpers import compare_runs, logged, run_parity, write_model_and_data

BASE = dict(sequence_len=256, sample_packing=False, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
            learning_rate=1e-3, lr_scheduler="linear", seed=0, optimizer="adamw_torch", adam_epsilon=1e-6,
            group_by_length=True, val_set_size=0.0)
LAYOUTS = {"fsdp2": ({"dp_shard_size": 2}, 2), "ddp": ({"dp_replicate_size": 2}, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("length_groups")
    data = write_model_and_data(root, n=96)  # 96 samples: megabatches of 3 global batches of 8
    shared = {**BASE, "base_model": data["model"], "datasets": [{"path": data["alpaca"], "type": "alpaca"}],
              "dataset_prepared_path": str(root / "prepared")}
    return run_parity(root, shared, LAYOUTS, dps=(2,),
                      variants={"ungrouped": {"group_by_length": False, "micro_batch_size": 4}})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_length_groups_match_one_process(runs, layout):
    losses, _ = compare_runs(runs / layout, runs / "ref2", rtol=1e-5, atol=1e-5, label=f"group_by_length {layout}")
    assert len(losses) == 4


def test_grouping_changes_the_batches(runs):
    grouped, plain = [r["loss"] for r in logged(runs / "ref2")], [r["loss"] for r in logged(runs / "ungrouped")]
    assert any(abs(a - b) > 1e-3 * abs(b) for a, b in zip(grouped, plain)), (grouped, plain)
