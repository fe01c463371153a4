"""`nd-parallel train`: the same Axolotl YAML under FSDP2, TP2, PP2 and CP2 vs one process.

Variants: completion (full fine-tuning, val_set_size + eval every 2 steps; with test_datasets (alpaca records,
eval_sequence_len) instead; with optimizer: muon; and with use_eaft on the same data), alpaca + LoRA
(curriculum_sampling; and LoftQ-initialized), chat_template with sample packing (full), alpaca + chat_template mixed
with sample packing + LoRA, and the real-world LoRA YAML's keys
(gradient_checkpointing, fsdp_config, evals_per_epoch, special_tokens with a new pad token, cosine + warmup).
Gradient accumulation 2, linear LR, seed 0, 3 steps (no epoch ends: there accelerate's dp sharding repeats samples
to even out the ranks). The 36 runs share one 2-rank launch, the references one process. For FSDP2 the reference's
micro_batch_size is doubled (its one rank takes both dp ranks' samples: the same global batches); everything else in
its YAML is the same. Compared: every train_log.jsonl loss and eval loss (rtol 1e-5), and the saved model or adapter
(atol 1e-5).
"""

import pytest
import torch

from tests.distributed.train_yaml_helpers import (
    chat_entry,
    jobs_for,
    logged,
    run_jobs,
    saved_tensors,
    write_model_and_data,
    write_yaml,
)

BASE = dict(sequence_len=160, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
            lr_scheduler="linear", weight_decay=0.01, seed=0, adam_epsilon=1e-6, optimizer="adamw_torch", bf16="auto",
            wandb_project=None, strict=False)
LORA = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_linear=True)
LAYOUTS = {"fsdp2": ({"dp_shard_size": 2}, 2), "tp2": ({"tensor_parallel_size": 2}, 1),
           "pp2": ({"pipeline_parallel_size": 2}, 1), "cp2": ({"context_parallel_size": 2}, 1)}


def _variants(data):
    alpaca = {"path": data["alpaca"], "ds_type": "json", "type": "alpaca"}
    return {
        "completion": dict(datasets=[{"path": data["text"], "type": "completion"}], val_set_size=0.25, eval_steps=2),
        # test_datasets: the evaluation data from its own entries, filtered by eval_sequence_len
        "completion_test": dict(datasets=[{"path": data["text"], "type": "completion"}], test_datasets=[alpaca],
                                eval_sequence_len=200, eval_steps=2),
        "alpaca_lora": dict(datasets=[alpaca], curriculum_sampling=True, **LORA),  # in order: the sequential sampler
        # LoftQ: each adapted base weight replaced by its NF4 round trip, LoRA started from the SVD of the rest
        "alpaca_loftq": dict(datasets=[alpaca], curriculum_sampling=True, peft={"loftq_config": {"loftq_bits": 4}},
                             **LORA),
        # Muon orthogonalizes each whole hidden matrix, all-gathered from its FSDP / TP shards (distributed/muon.py)
        "completion_muon": dict(datasets=[{"path": data["text"], "type": "completion"}], optimizer="muon"),
        # EAFT: each token's loss weighted by its top-k entropy, the model's loss function under every layout
        "completion_eaft": dict(datasets=[{"path": data["text"], "type": "completion"}], val_set_size=0.25,
                                eval_steps=2, use_eaft=True, eaft_alpha=0.5, eaft_k=8),
        "chat_packed": dict(datasets=[chat_entry(data["chat"])], sample_packing=True),
        "mixed_packed_lora": dict(datasets=[alpaca, chat_entry(data["chat"])], sample_packing=True, **LORA),
        # the keys of the real-world LoRA YAML (tests/unit/test_train_yaml.py) that change what a run does; no
        # gradient accumulation, so that its densely packed rows last beyond the 3 steps under dp 2 (an epoch's end
        # repeats samples to even out the ranks)
        "real_world_lora": dict(datasets=[alpaca], sample_packing=True, gradient_accumulation_steps=1, pad_to_sequence_len=True, val_set_size=0.25,
                           evals_per_epoch=2, gradient_checkpointing=True, lr_scheduler="cosine", warmup_steps=1,
                           special_tokens={"pad_token": "<pad>"}, fsdp_version=2,
                           fsdp_config={"reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT",
                                        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                        "transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, **LORA),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_yaml")
    data = write_model_and_data(root, n=96)  # no run reaches an epoch's end (where dp sharding pads)
    variants = _variants(data)
    shared = {"base_model": data["model"], "dataset_prepared_path": str(root / "prepared")}  # tokenized once per variant
    parallel, refs = [], []
    for variant, keys in variants.items():
        for layout, (sizes, dp) in LAYOUTS.items():
            out = root / f"{variant}-{layout}"
            parallel.append(write_yaml(root / f"{variant}-{layout}.yaml",
                                       {**BASE, **keys, **sizes, **shared, "output_dir": str(out)}))
        for dp in (1, 2):
            cfg = {**BASE, **keys, **shared, "output_dir": str(root / f"{variant}-ref{dp}"),
                   "micro_batch_size": keys.get("micro_batch_size", BASE["micro_batch_size"]) * dp}
            refs.append(write_yaml(root / f"{variant}-ref{dp}.yaml", cfg))
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2)
    return root


VARIANTS = ("completion", "completion_test", "completion_muon", "completion_eaft", "alpaca_lora", "alpaca_loftq",
            "chat_packed",
            "mixed_packed_lora", "real_world_lora")
CASES = [(v, lay) for v in VARIANTS for lay in LAYOUTS]
# eval_steps 2: step 2 and the last; evals_per_epoch: the last
EVALS = {"completion": 2, "completion_test": 2, "completion_eaft": 2, "real_world_lora": 1}


@pytest.mark.parametrize("variant,layout", CASES, ids=[f"{v}-{lay}" for v, lay in CASES])
def test_same_yaml_matches_one_process(runs, variant, layout):
    dp = LAYOUTS[layout][1]
    got, ref = runs / f"{variant}-{layout}", runs / f"{variant}-ref{dp}"
    losses, ref_losses = [r["loss"] for r in logged(got)], [r["loss"] for r in logged(ref)]
    assert [r["step"] for r in logged(got)] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    if "lora" not in variant:  # 3 LoRA steps from B = 0 move the loss too little to fall reliably
        assert ref_losses[-1] < ref_losses[0]
    evals, ref_evals = logged(got, "eval_log.jsonl"), logged(ref, "eval_log.jsonl")
    assert len(evals) == len(ref_evals) == EVALS.get(variant, 0), (evals, ref_evals)
    for a, b in zip(evals, ref_evals):
        assert a["step"] == b["step"] and abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * abs(b["eval_loss"])
    tensors, ref_tensors = saved_tensors(got), saved_tensors(ref)
    assert set(tensors) == set(ref_tensors) and tensors
    worst = max((tensors[k] - v).abs().max().item() for k, v in ref_tensors.items())
    print(f"{variant} {layout}: losses {losses} max loss rel diff "
          f"{max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)):.2e} saved-tensor diff {worst:.2e}")
    assert worst <= 1e-5
    if "lora" in variant:
        assert max(v.abs().max().item() for k, v in tensors.items() if "lora_B" in k) > 0  # the adapter trained
        assert (got / "adapter_config.json").is_file() and not (got / "model.safetensors").exists()
    assert (got / "tokenizer.json").is_file()


def test_eaft_changes_the_loss(runs):
    """completion_eaft is completion with use_eaft: the same data and evaluation, so only the entropy weights make
    its losses differ (a run that ignored use_eaft would match completion's exactly)."""
    for dp in (1, 2):
        plain, eaft = logged(runs / f"completion-ref{dp}"), logged(runs / f"completion_eaft-ref{dp}")
        for a, b in zip(plain, eaft):
            assert abs(a["loss"] - b["loss"]) > 0.05 * abs(a["loss"]), (a, b)


def test_loftq_starts_from_the_quantized_base(runs):
    """alpaca_loftq is alpaca_lora with LoftQ (the same samples in the same order): its first loss is the quantized
    base's plus the SVD start, not the unchanged base's (B = 0); a run that ignored the key would match exactly."""
    plain, loftq = logged(runs / "alpaca_lora-ref1")[0]["loss"], logged(runs / "alpaca_loftq-ref1")[0]["loss"]
    assert plain != loftq, (plain, loftq)
