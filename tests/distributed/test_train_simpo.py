"""rl: simpo (TRL's CPOTrainer with loss_type simpo, as Axolotl runs it; plugins/trainer/cpo.py) through
`nd-parallel train`: FSDP2, DDP, TP2 and CP2 equal one process on the global batch (every loss, every saved tensor):
the SimPO term a mean over the global batch's pairs and the cpo_alpha NLL a mean over its chosen answer tokens,
whatever their split over the ranks. Rows: full fine-tuning with the NLL term (cpo_alpha 1.0) and LoRA without it
(cpo_alpha 0, SimPO alone). ChatML prompt / chosen / rejected records of different lengths, 3 steps of 8 pairs.
Tolerance: fp32 reduction order only: loss rtol 1e-5, saved tensors atol 1e-5."""

import json

import pytest

from tests.distributed.train_yaml_helpers import compare_runs, logged, run_groups, write_model_and_data

BASE = dict(rl="simpo", micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
            lr_scheduler="linear", seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64,
            val_set_size=0.0, rl_beta=2.0, simpo_gamma=0.5)
ROWS = {"full_nll": {"cpo_alpha": 1.0},
        "lora": {"cpo_alpha": 0.0, "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                 "lora_target_linear": True}}
GROUPS = {"dp": ({"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2}}, {"micro_batch_size": 4}),
          "mp": ({"tp2": {"tensor_parallel_size": 2}, "cp2": {"context_parallel_size": 2}}, {})}
CASES = [(row, group, layout) for row in ROWS for group, (layouts, _) in GROUPS.items() for layout in layouts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("simpo")
    data = write_model_and_data(root, n=48)
    lines = [json.loads(x)["text"] for x in open(data["text"])]
    pairs = [{"prompt": lines[i][:30], "chosen": lines[i + 1][:20 + i % 20], "rejected": lines[i + 2][:44 - i % 20]}
             for i in range(0, 48, 3)]  # 16 pairs: whole global batches of 8
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    common = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "datasets": [{"path": str(root / "pairs.jsonl"), "type": "chatml.prompt_pairs"}]}
    return run_groups(root, {row: {**common, **keys} for row, keys in ROWS.items()}, GROUPS)


@pytest.mark.parametrize("row,group,layout", CASES)
def test_simpo_matches_one_process(runs, row, group, layout):
    compare_runs(runs / group / f"{row}_{layout}", runs / group / f"{row}_ref", rtol=1e-5, atol=1e-5,
                 label=f"simpo {row} {layout}")


def test_the_nll_term_is_in_the_loss(runs):
    with_nll, without = logged(runs / "dp" / "full_nll_ref"), logged(runs / "dp" / "lora_ref")
    assert with_nll[0]["loss"] > without[0]["loss"] + 1.0  # + the chosen answers' NLL (about ln(vocab))
