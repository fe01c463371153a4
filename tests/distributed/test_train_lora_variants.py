"""DoRA (`peft_use_dora`), LoRA+ (`loraplus_lr_ratio` / `loraplus_lr_embedding`), peft's per-module ranks and layer
selection (`lora_rank_pattern`, `lora_alpha_pattern`, `peft_layers_to_transform`, `peft_layers_pattern`, with
`lr_scheduler_kwargs`) and Axolotl's optimizer groups (`embedding_lr_scale`, `lr_groups`) through `nd-parallel
train`: FSDP2 and DDP equal one process on the global batch (every loss, every saved tensor), and each feature
changes the run (the same YAML without it, in one process, ends elsewhere).

Rows: DoRA on every linear layer; LoRA+ at ratio 16 with LoRA on the embedding too (its own rate); LoRA on layer 1
only with rank 8 / alpha 32 on q_proj and a one-cycle cosine (num_cycles 1.0); NEFTune (alpha 5, by its older
name noisy_embedding_alpha; rows padded to sequence_len, so every micro-batch has the same noise scale; each row's
noise keyed by its tokens) on full fine-tuning; full fine-tuning
with the embeddings at half the rate and the attention projections in a group of their own (weight decay 0.1);
full fine-tuning with optimizer: sgd, rmsprop and lion_32bit (bitsandbytes' Lion, stepping each rank's shards).
Tolerance: only fp32 reduction order differs: loss rtol 1e-5, saved tensors atol 1e-5 (AdamW, epsilon 1e-6).
"""

import json

import pytest
import torch

from tests.distributed.train_yaml_helpers import compare_runs, run_rows, saved_tensors, write_model_and_data

BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=2e-3, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64, val_set_size=0.0, weight_decay=0.1)
LORA = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0)
ROWS = {  # name: (the row's keys, the keys that turn its feature off)
    "dora": ({**LORA, "lora_target_linear": True, "peft_use_dora": True}, {"peft_use_dora": None}),
    "loraplus": ({**LORA, "lora_target_modules": ["q_proj", "v_proj", "embed_tokens"], "loraplus_lr_ratio": 16,
                  "loraplus_lr_embedding": 1e-4}, {"loraplus_lr_ratio": None, "loraplus_lr_embedding": None}),
    "patterns": ({**LORA, "lora_target_linear": True, "lora_rank_pattern": {"q_proj": 8}, "lora_alpha_pattern": {
        "q_proj": 32}, "peft_layers_to_transform": [1], "peft_layers_pattern": "layers", "lr_scheduler": "cosine",
        "lr_scheduler_kwargs": {"num_cycles": 1.0}}, {"lora_rank_pattern": None, "lora_alpha_pattern": None,
                                                      "peft_layers_to_transform": None, "peft_layers_pattern": None}),
    "neftune": ({"noisy_embedding_alpha": 5, "pad_to_sequence_len": True}, {"noisy_embedding_alpha": None}),
    # optimizers the Trainer builds from its own list (element-wise: each shard's step is one process's). RMSprop's
    # first step is lr x g / sqrt(0.01 g^2) = 10 lr for every element, however small its gradient, so fp32 reduction
    # order is amplified as by Adam with a tiny epsilon: its rate is 1e-4
    **{name: ({"optimizer": name, "learning_rate": lr}, {"optimizer": None, "learning_rate": None})
       for name, lr in (("sgd", 1e-2), ("rmsprop", 1e-4), ("lion_32bit", 1e-3))},
    "groups": ({"embedding_lr_scale": 0.5, "lr_groups": [{"name": "attention", "modules": ["self_attn"],
                                                           "lr": 5e-4}]}, {"embedding_lr_scale": None,
                                                                           "lr_groups": None}),
}
LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_variants")
    data = write_model_and_data(root, n=48)
    common = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "datasets": [{"path": data["text"], "type": "completion"}]}
    return run_rows(root, {row: {**common, **keys} for row, (keys, _) in ROWS.items()}, LAYOUTS,
                    {"micro_batch_size": 4}, {row: off for row, (_, off) in ROWS.items()})


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_variant_matches_one_process(runs, row, layout):
    compare_runs(runs / f"{row}_{layout}", runs / f"{row}_ref", rtol=1e-5, atol=1e-5, label=f"{row} {layout}")


@pytest.mark.parametrize("row", list(ROWS))
def test_the_feature_changes_the_run(runs, row):
    """Not a vacuous row: the same run without the feature saves other tensors (DoRA: magnitude vectors too)."""
    got, plain = saved_tensors(runs / f"{row}_ref"), saved_tensors(runs / f"{row}_plain")
    if row == "patterns":  # LoRA on layer 1 only, rank 8 on q_proj
        assert not any(".layers.0." in k for k in got) and any(".layers.0." in k for k in plain)
        assert {v.shape[0] for k, v in got.items() if "q_proj.lora_A" in k} == {8}
        return
    if row == "dora":
        assert any("lora_magnitude_vector" in k for k in got) and not any("magnitude" in k for k in plain)
        config = json.loads((runs / f"{row}_ref" / "adapter_config.json").read_text())
        assert config["use_dora"] is True
        return
    shared = set(got) & set(plain)
    assert shared and max((got[k] - plain[k]).abs().max().item() for k in shared) > 1e-4


def test_loraplus_steps_b_faster_than_a(runs):
    """LoRA+ at ratio 16: after the same steps the B factors moved further from 0 relative to plain LoRA."""
    got, plain = saved_tensors(runs / "loraplus_ref"), saved_tensors(runs / "loraplus_plain")
    bs = [k for k in got if "lora_B" in k and "embed" not in k]
    ratio = torch.tensor([got[k].norm() / plain[k].norm() for k in bs])
    assert bs and (ratio > 4).all(), ratio
