"""Axolotl's dpo_* keys through `nd-parallel train` (preference.dpo_args: DPOConfig's loss_type, loss_weights,
label_smoothing, use_weighting, as Axolotl's DPOStrategy passes them): FSDP2 and DDP equal one process on the global
batch, and each setting changes the run (the same YAML with TRL's default sigmoid loss ends elsewhere).

Rows: LoRA with a weighted sum of the sigmoid and hinge losses (weights 1.0 / 0.5); full fine-tuning with
conservative DPO (label smoothing 0.1) and WPO weighting. ChatML prompt / chosen / rejected records
(chatml.prompt_pairs), 3 steps of 8 pairs. Tolerance: fp32 reduction order only: loss rtol 1e-5, saved tensors
atol 1e-5 (lr 1e-3: test_dpo.py explains why DPO's near-cancelling gradients want it).
"""

import json

import pytest

from tests.distributed.train_yaml_helpers import compare_runs, logged, run_rows, write_model_and_data

BASE = dict(rl="dpo", micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
            lr_scheduler="linear", seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64,
            val_set_size=0.0, rl_beta=0.1)
ROWS = {
    "mpo_lora": {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": True,
                 "dpo_loss_type": ["sigmoid", "hinge"], "dpo_loss_weights": [1.0, 0.5]},
    "cdpo_full": {"dpo_label_smoothing": 0.1, "dpo_use_weighting": True},
}
OFF = ("dpo_loss_type", "dpo_loss_weights", "dpo_use_weighting", "dpo_label_smoothing")
LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_options")
    data = write_model_and_data(root, n=48)
    lines = [json.loads(x)["text"] for x in open(data["text"])]
    pairs = [{"prompt": lines[i][:40], "chosen": lines[i + 1][:40], "rejected": lines[i + 2][:40]}
             for i in range(0, 48, 3)]  # 16: whole global batches of 8 (a ragged last one is filled per rank)
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    common = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "datasets": [{"path": str(root / "pairs.jsonl"), "type": "chatml.prompt_pairs"}]}
    return run_rows(root, {row: {**common, **keys} for row, keys in ROWS.items()}, LAYOUTS, {"micro_batch_size": 4},
                    {row: {k: None for k in OFF} for row in ROWS})


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dpo_options_match_one_process(runs, row, layout):
    compare_runs(runs / f"{row}_{layout}", runs / f"{row}_ref", rtol=1e-5, atol=1e-5, label=f"dpo {row} {layout}")


@pytest.mark.parametrize("row", list(ROWS))
def test_the_options_change_the_loss(runs, row):
    got, plain = [r["loss"] for r in logged(runs / f"{row}_ref")], [r["loss"] for r in logged(runs / f"{row}_plain")]
    assert abs(got[0] - plain[0]) > 1e-3, (got, plain)  # from the first step: another loss of the same model
