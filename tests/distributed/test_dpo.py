"""TRL DPOTrainer rows: an unchanged DPOTrainer with NDParallelCallback matches DPOTrainer in one process.

One launch of 2 ranks runs FSDP2, DDP, TP and CP rows (CP: the fused head's per-token outputs gathered back into
the whole sequence, context_parallel/token_outputs.py), with a LoRA adapter (the reference policy is the base with the
adapter disabled) and full fine-tuning (DPOTrainer's own frozen reference copy, prepared under the same layout).
Same data, seed, gradient accumulation (2), sigmoid loss (beta 0.1) and linear schedule; the one-process
DPOTrainer's per-device batch is the layout's global batch (pairs). Compared: every logged loss and grad norm
(rtol 1e-5), the reward margins and chosen log-probs (gathered over the dp ranks: the global batch's means), the
evaluations from step 2 on (loss, chosen log-probs), every parameter at the end (atol 1e-5).

Why lr 1e-3 (the SFT rows use 1e-2): DPO's gradient is a difference of the chosen and the rejected sequences'
log-prob gradients, so more of its elements are near zero, where AdamW's update m/(sqrt(v)+eps) turns a gradient's
fp32 rounding (a different summation order under TP) into an update difference proportional to lr. Measured on the
full fine-tuning TP row: max parameter difference 1.9e-5 at lr 1e-2, 1.9e-6 at lr 1e-3 (linear in lr, as an update-
level difference is; losses and grad norms agree to 1e-6 relative either way).
"""

import pytest
import torch

from tests.distributed import preference_rows
from tests.distributed.preference_rows import launch_rows, rel

ARGS = dict(gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1, save_strategy="no",
            adam_epsilon=1e-6, weight_decay=0.01, seed=0, lr_scheduler_type="linear", max_grad_norm=1.0,
            max_length=48, bf16=False, beta=0.1)
PER_RANK = 2  # pairs per rank per micro-batch
ROWS = {"fsdp2_lora": ({"dp_shard_size": 2}, {"lora": True}),
        "fsdp2_full": ({"dp_shard_size": 2}, {}),
        "ddp2_full": ({"dp_replicate_size": 2}, {}),
        "tp2_lora": ({"tp_size": 2}, {"lora": True}),
        "tp2_full": ({"tp_size": 2}, {}),
        "cp2_lora": ({"cp_size": 2}, {"lora": True}),
        "cp2_full": ({"cp_size": 2}, {})}


@pytest.fixture(scope="module")
def run(tiny_model, launch_worker):
    return launch_rows(launch_worker, "dpo_2r", "dpo", tiny_model("llama"), ROWS, ARGS, PER_RANK)


@pytest.fixture(scope="module")
def references(tiny_model, memo, worker_env, tmp_path_factory):
    return preference_rows.references("dpo", tiny_model("llama"), ROWS, ARGS, PER_RANK, memo, worker_env,
                                      tmp_path_factory)


@pytest.mark.parametrize("row", list(ROWS))
def test_dpo_trainer_matches_one_process(row, run, references):
    got, want = torch.load(run / f"{row}.pt", weights_only=True), references(row)
    assert len(got["loss"]) == len(want["loss"]) == ARGS["max_steps"]
    for key in ("loss", "grad_norm", "logps/chosen"):
        for a, b in zip(got[key], want[key]):
            assert rel(a, b) <= 1e-5, (key, got[key], want[key])
    for a, b in zip(got["rewards/margins"], want["rewards/margins"]):  # ~1e-3: compared absolutely
        assert abs(a - b) <= 1e-6, (got["rewards/margins"], want["rewards/margins"])
    assert max(abs(m) for m in want["rewards/margins"][1:]) > 1e-5  # the policy moved away from the reference
    assert len(got["eval_loss"]) == len(want["eval_loss"]) >= 1  # from step 2 on, on 8 other pairs
    for key in ("eval_loss", "eval_logps/chosen"):
        for a, b in zip(got[key], want[key]):
            assert rel(a, b) <= 1e-5, (key, got[key], want[key])
    assert set(got["state"]) == set(want["state"])
    diff = max((got["state"][k] - v).abs().max().item() for k, v in want["state"].items())
    assert diff <= 1e-5, diff
    print(f"dpo {row}: losses {got['loss']} param diff {diff:.1e}")
