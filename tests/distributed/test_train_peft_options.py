"""peft's LoRA options Axolotl passes through (cli/train/adapter_options.py) through `nd-parallel train`: each
layout equals one process on the global batch (every loss, every saved tensor), and each feature changes the run
(the same YAML without it, in one process, ends elsewhere).

Rows: `peft_trainable_token_indices` (LoRA on q_proj / v_proj plus 6 embedding rows of the tied Llama, with
`peft_ensure_weight_tying` and `peft_autocast_adapter_dtype: false`) under FSDP2 and DDP; `peft_layer_replication`
(the 2-layer stack rebuilt as layers 0, 1, 1: the copy shares its base weights, with its own LoRA; FSDP2 shards the
layers sharing weights as one group, distributed/fsdp.sharing_groups) under FSDP2 and DDP (TP / PP are refused
before any rank starts: tests/unit/test_adapter_options.py).
Tolerance: only fp32 reduction order differs: loss rtol 1e-5, saved tensors atol 1e-5 (AdamW, epsilon 1e-6).
"""

import pytest

from tests.distributed.train_yaml_helpers import compare_runs, run_rows, saved_tensors, write_model_and_data

BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3, learning_rate=2e-3, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64, val_set_size=0.0,
            adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["q_proj", "v_proj"])
TOKENS = [5, 9, 17, 33, 40, 63]
ROWS = {  # name: (the row's keys, the keys that turn its feature off, its layouts)
    "tokens": ({"peft_trainable_token_indices": TOKENS, "peft_ensure_weight_tying": True,
                "peft_autocast_adapter_dtype": False},
               {"peft_trainable_token_indices": None, "peft_ensure_weight_tying": None}, ["fsdp2", "ddp"]),
    "replication": ({"peft_layer_replication": [[0, 2], [1, 2]]}, {"peft_layer_replication": None},
                    ["fsdp2", "ddp"]),
}
LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2}}
CASES = [(row, layout) for row, (_, _, layouts) in ROWS.items() for layout in layouts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_options")
    data = write_model_and_data(root, n=48)
    common = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "datasets": [{"path": data["text"], "type": "completion"}]}
    return run_rows(root, {row: {**common, **keys} for row, (keys, _, _) in ROWS.items()}, LAYOUTS,
                    {"micro_batch_size": 4}, {row: off for row, (_, off, _) in ROWS.items()},
                    {row: layouts for row, (_, _, layouts) in ROWS.items()})


@pytest.mark.parametrize("row,layout", CASES)
def test_the_option_matches_one_process(runs, row, layout):
    compare_runs(runs / f"{row}_{layout}", runs / f"{row}_ref", rtol=1e-5, atol=1e-5, label=f"{row} {layout}")


def test_the_token_rows_train(runs):
    """The adapter holds a trained delta for exactly the listed rows (peft's trainable_tokens_delta), moved from 0."""
    got, plain = saved_tensors(runs / "tokens_ref"), saved_tensors(runs / "tokens_plain")
    deltas = {k: v for k, v in got.items() if "trainable_tokens_delta" in k}
    assert deltas and not any("trainable_tokens" in k for k in plain), sorted(got)
    assert all(v.shape[0] == len(TOKENS) and v.abs().max() > 1e-4 for v in deltas.values()), deltas


def test_the_replicated_layer_has_its_own_adapter(runs):
    """Layers 0, 1, 1: three adapted layers, the copy's LoRA trained apart from the original's."""
    got, plain = saved_tensors(runs / "replication_ref"), saved_tensors(runs / "replication_plain")
    layers = {k.split(".layers.")[1].split(".")[0] for k in got if ".layers." in k}
    assert layers == {"0", "1", "2"} and {k.split(".layers.")[1].split(".")[0] for k in plain if ".layers." in k} == {
        "0", "1"}, sorted(got)
    b1, b2 = (got[next(k for k in got if f".layers.{i}.self_attn.q_proj.lora_B" in k)] for i in (1, 2))
    assert (b1 - b2).abs().max() > 1e-5
