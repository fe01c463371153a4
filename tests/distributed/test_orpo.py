"""TRL ORPOTrainer rows: an unchanged ORPOTrainer (trl.experimental.orpo) with NDParallelCallback matches
ORPOTrainer in one process.

One launch of 2 ranks runs FSDP2 (LoRA and full fine-tuning), TP2 (LoRA and full) and CP2 (LoRA and full) rows, as
test_dpo.py does for DPO (plugins/trainer/orpo.py: the chosen NLL as the global batch's token mean, the odds-ratio
term as its pair mean; under CP the whole logits gathered with their gradients). Same data (prompt / chosen /
rejected strings of different lengths, so the dp ranks hold different numbers of chosen tokens: a mean of the
ranks' NLL means would differ from the global token mean), seed, gradient accumulation (2), ORPO loss (beta 0.1) and
linear schedule; the one-process ORPOTrainer's per-device batch is the layout's global batch. Compared: every logged
loss, grad norm, NLL and mean log-odds ratio (rtol 1e-5), the chosen log-probs and reward margins, the evaluations
from step 2 on (loss, NLL), every parameter at the end (atol 1e-5). lr 1e-3, for the reason test_dpo.py gives (the
odds-ratio gradient is a difference of the chosen and rejected log-prob gradients).
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
        "tp2_lora": ({"tp_size": 2}, {"lora": True}),
        "tp2_full": ({"tp_size": 2}, {}),
        "cp2_lora": ({"cp_size": 2}, {"lora": True}),
        "cp2_full": ({"cp_size": 2}, {})}


@pytest.fixture(scope="module")
def run(tiny_model, launch_worker):
    return launch_rows(launch_worker, "orpo_2r", "orpo", tiny_model("llama"), ROWS, ARGS, PER_RANK)


@pytest.fixture(scope="module")
def references(tiny_model, memo, worker_env, tmp_path_factory):
    return preference_rows.references("orpo", tiny_model("llama"), ROWS, ARGS, PER_RANK, memo, worker_env,
                                      tmp_path_factory)


@pytest.mark.parametrize("row", list(ROWS))
def test_orpo_trainer_matches_one_process(row, run, references):
    got, want = torch.load(run / f"{row}.pt", weights_only=True), references(row)
    assert len(got["loss"]) == len(want["loss"]) == ARGS["max_steps"]
    for key in ("loss", "grad_norm", "nll_loss", "log_odds_ratio", "logps/chosen", "eval_loss", "eval_nll_loss"):
        assert len(got[key]) == len(want[key]) >= 1, key
        for a, b in zip(got[key], want[key]):
            assert rel(a, b) <= 1e-5, (key, got[key], want[key])
    for a, b in zip(got["rewards/margins"], want["rewards/margins"]):  # beta * a difference of ~1: absolutely
        assert abs(a - b) <= 1e-6, (got["rewards/margins"], want["rewards/margins"])
    assert set(got["state"]) == set(want["state"])
    diff = max((got["state"][k] - v).abs().max().item() for k, v in want["state"].items())
    assert diff <= 1e-5, diff
    print(f"orpo {row}: losses {got['loss']} nll {got['nll_loss']} param diff {diff:.1e}")
