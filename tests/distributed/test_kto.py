"""TRL KTOTrainer rows: an unchanged KTOTrainer with NDParallelCallback matches KTOTrainer in one process.

One launch of 2 ranks runs FSDP2 (LoRA and full fine-tuning), TP2 (LoRA) and CP2 (LoRA and full) rows, as
test_dpo.py does for DPO (plugins/trainer/kto.py: the loss as the mean over the global batch's examples; the fused
head's log-probs as for DPO). Same data (prompt / completion / label, both labels mixed), seed, gradient
accumulation (2), KTO loss (beta 0.1, desirable_weight 1.5) and linear schedule; the one-process KTOTrainer's
per-device batch is the layout's global batch. KTOTrainer fixes which completion its KL estimate pairs with each
prompt when it prepares the data (rotated within blocks of per_device_train_batch_size rows), so the one-process
reference prepares its data with the rank's per-device batch (``prepare_batch``): both then estimate the KL term on
the same mismatched pairs. Compared: every logged loss and grad norm (rtol 1e-5), the log-probs and the evaluations
from step 2 on (rtol 1e-5), the KL estimates (4 fp32 ulps of the log-prob sums they are differences of), every
parameter at the end (atol 1e-5). lr 1e-3, for the reason test_dpo.py gives (a difference of log-prob gradients).
"""

import pytest
import torch

from tests.distributed import preference_rows
from tests.distributed.preference_rows import launch_rows, rel

ARGS = dict(gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1, save_strategy="no",
            adam_epsilon=1e-6, weight_decay=0.01, seed=0, lr_scheduler_type="linear", max_grad_norm=1.0,
            max_length=48, bf16=False, beta=0.1, desirable_weight=1.5)
PER_RANK = 2  # examples per rank per micro-batch
ROWS = {"fsdp2_lora": ({"dp_shard_size": 2}, {"lora": True}),
        "fsdp2_full": ({"dp_shard_size": 2}, {}),
        "tp2_lora": ({"tp_size": 2}, {"lora": True}),
        "cp2_lora": ({"cp_size": 2}, {"lora": True}),
        "cp2_full": ({"cp_size": 2}, {})}


@pytest.fixture(scope="module")
def run(tiny_model, launch_worker):
    return launch_rows(launch_worker, "kto_2r", "kto", tiny_model("llama"), ROWS, ARGS, PER_RANK)


@pytest.fixture(scope="module")
def references(tiny_model, memo, worker_env, tmp_path_factory):
    return preference_rows.references("kto", tiny_model("llama"), ROWS, ARGS, PER_RANK, memo, worker_env,
                                      tmp_path_factory, reference_extras={"prepare_batch": PER_RANK})


@pytest.mark.parametrize("row", list(ROWS))
def test_kto_trainer_matches_one_process(row, run, references):
    got, want = torch.load(run / f"{row}.pt", weights_only=True), references(row)
    assert len(got["loss"]) == len(want["loss"]) == ARGS["max_steps"]
    for key in ("loss", "grad_norm"):
        for a, b in zip(got[key], want[key]):
            assert rel(a, b) <= 1e-5, (key, got[key], want[key])
    for key in ("logps/chosen", "logps/rejected", "eval_loss", "eval_logps/chosen"):
        assert [x is None for x in got[key]] == [x is None for x in want[key]], key  # a step without that label
        for a, b in zip(got[key], want[key]):
            assert a is None or rel(a, b) <= 1e-5, (key, got[key], want[key])
    # The KL estimate is a mean of differences of two sequence log-prob sums of ~|40..60| (policy - reference): a
    # different fp32 summation order moves each sum by about one ulp of its size, so it is compared to 4 ulps of
    # the largest sum, not relatively (the difference itself is ~1e-2).
    ulp = torch.finfo(torch.float32).eps * max(abs(x) for k in ("logps/chosen", "logps/rejected")
                                               for x in want[k] if x is not None)
    for key in ("kl", "eval_kl"):
        for a, b in zip(got[key], want[key]):
            assert abs(a - b) <= 4 * ulp, (key, got[key], want[key], ulp)
    assert max(want["kl"][1:]) > 100 * ulp  # the policy moved: the estimate is not the clamp's 0
    assert len(got["eval_loss"]) == len(want["eval_loss"]) >= 1
    assert set(got["state"]) == set(want["state"])
    diff = max((got["state"][k] - v).abs().max().item() for k, v in want["state"].items())
    assert diff <= 1e-5, diff
    print(f"kto {row}: losses {got['loss']} kl {got['kl']} param diff {diff:.1e}")
