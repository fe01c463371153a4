"""TRL ORPOTrainer rows: an unchanged ORPOTrainer (trl.experimental.orpo) with NDParallelCallback matches
ORPOTrainer in one process.

One launch of 2 ranks runs FSDP2 (LoRA and full fine-tuning), TP2 (LoRA and full) and CP2 (LoRA and full) rows, as
test_dpo.py does for DPO (plugins/trainer/orpo.py: the chosen NLL as the global batch's token mean, the odds-ratio
term as its pair mean; under CP the whole logits gathered with their gradients). Same data (prompt / chosen /
rejected strings of different lengths, so the dp ranks hold different numbers of chosen tokens: a mean of the
ranks' NLL means would differ from the global token mean), seed, gradient accumulation (2), ORPO loss (beta 0.1) and
linear schedule; the one-process ORPOTrainer's per-device batch is the layout's global batch. Compared: every logged
loss and NLL and the evaluations from step 2 on (rtol 1e-6), grad norm, mean log-odds ratio and chosen log-probs
(rtol 1e-5), reward margins (1e-6 absolute), every parameter at the end (atol 1e-5).

Tolerances, measured on this machine: losses and NLLs within 9e-8 relative (about one fp32 ulp), grad norms 2.2e-7,
parameters 7.6e-7. Averaging the dp ranks' own NLL means instead of the global token mean (the defect this guards
against) moves the FSDP2 rows' losses by 7.5e-5 relative: 75 times the 1e-6 bound. lr 1e-3, for the reason
test_dpo.py gives (the odds-ratio gradient is a difference of the chosen and rejected log-prob gradients).
"""

import pytest
import torch

from tests.distributed.preference_rows import BASE_ARGS, lora_and_full, rel, row_fixtures

ARGS = dict(BASE_ARGS, beta=0.1)
ROWS = lora_and_full({"fsdp2": {"dp_shard_size": 2}, "tp2": {"tp_size": 2}, "cp2": {"cp_size": 2}})
run, references = row_fixtures("orpo", ROWS, ARGS, per_rank=2)  # 2 pairs per rank per micro-batch


@pytest.mark.parametrize("row", list(ROWS))
def test_orpo_trainer_matches_one_process(row, run, references):
    got, want = torch.load(run / f"{row}.pt", weights_only=True), references(row)
    assert len(got["loss"]) == len(want["loss"]) == ARGS["max_steps"]
    for key, rtol in [("loss", 1e-6), ("nll_loss", 1e-6), ("eval_loss", 1e-6), ("eval_nll_loss", 1e-6),
                      ("grad_norm", 1e-5), ("log_odds_ratio", 1e-5), ("logps/chosen", 1e-5)]:
        assert len(got[key]) == len(want[key]) >= 1, key
        for a, b in zip(got[key], want[key]):
            assert rel(a, b) <= rtol, (key, got[key], want[key])
    for a, b in zip(got["rewards/margins"], want["rewards/margins"]):  # beta * a difference of ~1: absolutely
        assert abs(a - b) <= 1e-6, (got["rewards/margins"], want["rewards/margins"])
    assert set(got["state"]) == set(want["state"])
    diff = max((got["state"][k] - v).abs().max().item() for k, v in want["state"].items())
    assert diff <= 1e-5, diff
    worst = {k: max(rel(a, b) for a, b in zip(got[k], want[k])) for k in ("loss", "grad_norm", "nll_loss")}
    print(f"orpo {row}: losses {got['loss']} max rel {worst} param diff {diff:.1e}")
