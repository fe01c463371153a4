"""Reward-model rows: an unchanged TRL RewardTrainer (sequence-classification head) and the Trainer on a
token-classification head (a process reward model: what `nd-parallel train` runs for Axolotl's
process_reward_model, TRL 1.16 having no PRMTrainer) with NDParallelCallback match the same trainer in one process.

One launch of 2 ranks runs every row (preference_worker.py, as test_dpo.py / test_kto.py): the reward model under
FSDP2, DDP, TP2 (the score head replicated) and CP2 (the last non-pad token's logits gathered from the rank that
holds it: context_parallel/pooled_head.py), full fine-tuning and LoRA (peft's SEQ_CLS task: the head trained in full
through modules_to_save), with center_rewards_coefficient 0.01 (Axolotl's qwen3 example); the process reward model
under FSDP2, full and LoRA (TOKEN_CLS), and TP2, on stepwise_supervised records tokenized by nd-parallel train's own
function (data/reward.py). Same data, seed, gradient accumulation (2) and linear schedule; the one-process trainer's
per-device batch is the layout's global batch.

Compared: every logged loss and grad norm (rtol 1e-5: fp32, only the summation order differs), the reward model's
metrics gathered over the dp ranks (margin, mean / min / max reward: 1e-6 at the first step, 1e-5 after, derived
in the test; accuracy exactly), every evaluation loss (rtol 1e-5), every parameter at the end (atol 1e-5). lr 1e-3 for
the reason test_dpo.py gives: a pairwise loss's gradient is a difference of two sequences' gradients, where AdamW
turns fp32 rounding into an update difference proportional to lr.
"""

import pytest
import torch

from tests.distributed import preference_rows
from tests.distributed.preference_rows import launch_rows, rel

ARGS = dict(gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1, save_strategy="no",
            adam_epsilon=1e-6, weight_decay=0.01, seed=0, lr_scheduler_type="linear", max_grad_norm=1.0,
            max_length=48, bf16=False, center_rewards_coefficient=0.01)  # the Trainer (prm) ignores the last two
PER_RANK = 2  # pairs (reward) / sequences (prm) per rank per micro-batch
PRM = {"trainer": "prm"}
ROWS = {"rm_fsdp2_full": ({"dp_shard_size": 2}, {}),
        "rm_fsdp2_lora": ({"dp_shard_size": 2}, {"lora": True}),
        "rm_ddp2_full": ({"dp_replicate_size": 2}, {}),
        "rm_tp2_full": ({"tp_size": 2}, {}),
        "rm_tp2_lora": ({"tp_size": 2}, {"lora": True}),
        "rm_cp2_full": ({"cp_size": 2}, {}),
        "rm_cp2_lora": ({"cp_size": 2}, {"lora": True}),
        "prm_fsdp2_full": ({"dp_shard_size": 2}, PRM),
        "prm_fsdp2_lora": ({"dp_shard_size": 2}, {**PRM, "lora": True}),
        "prm_tp2_full": ({"tp_size": 2}, PRM)}


@pytest.fixture(scope="module")
def run(tiny_model, launch_worker):
    return launch_rows(launch_worker, "reward_2r", "reward", tiny_model("llama"), ROWS, ARGS, PER_RANK)


@pytest.fixture(scope="module")
def references(tiny_model, memo, worker_env, tmp_path_factory):
    return preference_rows.references("reward", tiny_model("llama"), ROWS, ARGS, PER_RANK, memo, worker_env,
                                      tmp_path_factory)


@pytest.mark.parametrize("row", list(ROWS))
def test_reward_trainer_matches_one_process(row, run, references):
    got, want = torch.load(run / f"{row}.pt", weights_only=True), references(row)
    assert len(got["loss"]) == len(want["loss"]) == ARGS["max_steps"]
    for key in ("loss", "grad_norm", "eval_loss"):
        assert len(got[key]) == len(want[key]) >= 1, key
        for a, b in zip(got[key], want[key]):
            assert rel(a, b) <= 1e-5, (key, got[key], want[key])
    if row.startswith("rm_"):
        assert got["accuracy"] == want["accuracy"]
        # Rewards are logits of size ~0.1-0.5. At step 1 (no update yet) only the forward's summation order differs:
        # 1e-6. Later they move with the parameters, whose fp32 drift is bounded by the atol 1e-5 below (AdamW
        # amplifies rounding where a gradient element is near zero: under CP2 full, one embedding element ends 9e-6
        # apart, and the rewards of step 3 ~4e-6): 1e-5. A wrongly pooled token moves a reward by ~1e-1.
        for key in ("margin", "mean_reward", "min_reward", "max_reward"):
            for step, (a, b) in enumerate(zip(got[key], want[key])):
                assert abs(a - b) <= (1e-6 if step == 0 else 1e-5), (key, step, got[key], want[key])
        assert max(abs(m) for m in want["margin"]) > 1e-3  # the head scores the two answers differently
    assert set(got["state"]) == set(want["state"])
    head = [k for k in want["state"] if "score" in k or "classifier" in k]
    assert head, list(want["state"])  # the classification head is compared (trained in full under LoRA)
    diff = max((got["state"][k] - v).abs().max().item() for k, v in want["state"].items())
    assert diff <= 1e-5, diff
    print(f"{row}: losses {got['loss']} param diff {diff:.1e}")
