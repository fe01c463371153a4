"""`use_onebitllms` (1.58-bit linear layers, nd_parallel/models/bitnet.py) through `nd-parallel train`: FSDP2, PP2
and CP2 vs one process on the global batch, and a run that must differ from the same YAML without the key.

Tolerance, derived as for QAT's int8-activation rows (tests/distributed/test_qat.py): ternary weights take one scale
per whole tensor (FSDP2 all-gathers it, PP holds whole layers), and the activation scale is per token, so the
layouts round the same tensors as one process; what differs is the fp32 reduction order (~1e-7 relative), and 8-bit
activation rounding turns that noise into a level flip wherever an activation lies within it of a boundary. The
first step (weights equal going in) is held to rtol 1e-5; the run to loss rtol 2e-5 and parameters atol 2e-4,
QAT's measured-drift bounds (measured here: see the printed diffs). Quantization itself moves the first loss by
far more (asserted: > 1e-3 relative), so a layout that dropped the BitNet layers could not pass.
"""

import pytest

from tests.distributed.train_yaml_helpers import compare_runs, logged, run_parity, write_model_and_data

BASE = dict(sequence_len=96, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
            lr_scheduler="linear", seed=0, optimizer="adamw_torch", bf16="auto", use_onebitllms=True)
LAYOUTS = {"fsdp2": ({"dp_shard_size": 2}, 2), "pp2": ({"pipeline_parallel_size": 2}, 1),
           "cp2": ({"context_parallel_size": 2}, 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bitnet")
    data = write_model_and_data(root, n=48)
    shared = {**BASE, "base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}],
              "dataset_prepared_path": str(root / "prepared")}
    return run_parity(root, shared, LAYOUTS, variants={"plain": {"use_onebitllms": False}})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_one_process(runs, layout):
    dp = LAYOUTS[layout][1]
    losses, _ = compare_runs(runs / layout, runs / f"ref{dp}", rtol=2e-5, atol=2e-4, first_rtol=1e-5,
                             label=f"bitnet {layout}")
    assert len(losses) == 3


def test_bitnet_changes_the_loss(runs):
    plain, bitnet = logged(runs / "plain")[0]["loss"], logged(runs / "ref1")[0]["loss"]
    assert abs(plain - bitnet) > 1e-3 * abs(plain), (plain, bitnet)
