"""Axolotl's diffusion plugin (masked-diffusion training, cli/train/diffusion.py) through `nd-parallel train`: packed
completion rows, gradient accumulation, FSDP2 and DDP vs one process on the global batch, and the loss is not the
causal one (the same YAML without the plugin).

Tolerance: every row's masking is drawn from a generator keyed by (seed, step, the row's tokens), so one process and
each layout mask the same tokens; the 4-D mask and the loss are per row, so what differs is the fp32 reduction order
of a full fine-tune: loss rtol 1e-5, parameters atol 1e-5 (AdamW's epsilon 1e-6 bounds its amplification of that
noise on entries whose gradient is at the noise level; measured: see the printed gaps).
"""

import pytest

from tests.distributed.train_yaml_helpers import compare_runs, logged, run_parity, write_model_and_data

BASE = dict(sequence_len=64, sample_packing=True, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
            learning_rate=1e-3, lr_scheduler="linear", seed=0, optimizer="adamw_torch", adam_epsilon=1e-6,
            bf16="auto", plugins=["axolotl.integrations.diffusion.DiffusionPlugin"],
            diffusion={"eps": "5e-4", "importance_weighting": True, "mask_token_id": 3, "noise_schedule": "cosine",
                       "generate_samples": False})
LAYOUTS = {"fsdp2": ({"dp_shard_size": 2}, 2), "ddp": ({"dp_replicate_size": 2}, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusion")
    data = write_model_and_data(root, n=96)  # 3 steps of 8 packed rows stay within the first epoch
    shared = {**BASE, "base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}],
              "dataset_prepared_path": str(root / "prepared")}
    return run_parity(root, shared, LAYOUTS, dps=(2,),
                      variants={"causal": {"plugins": None, "diffusion": None, "micro_batch_size": 4}})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_diffusion_training_matches_one_process(runs, layout):
    losses, _ = compare_runs(runs / layout, runs / "ref2", rtol=1e-5, atol=1e-5, label=f"diffusion {layout}")
    assert len(losses) == 3


def test_the_diffusion_loss_is_not_the_causal_one(runs):
    diffusion, causal = logged(runs / "ref2")[0]["loss"], logged(runs / "causal")[0]["loss"]
    assert abs(diffusion - causal) > 1e-2 * abs(causal), (diffusion, causal)
