"""`rl: ebft` with `ebft.mode: strided` through `nd-parallel train` (cli/train/ebft_strided.py): FSDP2 and DDP equal
one process on the same micro-batches: every loss and grad norm, every logged ebft/* metric (the same rollouts,
scored the same), every saved tensor.

Rows: LoRA on raw documents (Axolotl's ebft_pretrain transform, whitening, last_token, rloo) and full fine-tuning on
prompt / completion records (its ebft_strided_structured transform, mean_pooling, group_norm, top_p 0.9, ce_coef
0.1, min_completion_prefix 2: anchors after each micro-batch's prompt). Each step is 4 documents, 2 rollouts each.

Why they can be equal: rollouts are sampled with noise keyed by (seed, step, the document's tokens, the rollout, the
generation step), so one process and each layout draw the same tokens. The loss is Axolotl's per micro-batch mean
(the structured row's anchor is the micro-batch's longest prompt), so the reference runs the same micro-batches:
micro_batch_size 1 with gradient_accumulation_steps 4 in one process, 2 on each of 2 ranks (a global batch is the same
4 documents: the ranks take alternate micro-batches of the sampler's order). Tolerance: only fp32 reduction order
differs: losses, grad norms and metrics rtol 1e-5 (atol 1e-6 where a metric is near 0), tensors atol 1e-5 (AdamW,
epsilon 1e-6).
"""

import json

import pytest
import torch

from tests.distributed.train_yaml_helpers import logged, run_rows, saved_tensors, write_model_and_data

BASE = dict(micro_batch_size=1, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, lr_scheduler="linear",
            seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=40, val_set_size=0.0, rl="ebft")
STRIDED = dict(mode="strided", stride=6, context_length=6, generate_max_len=4, n_samples_per_prompt=2,
               temperature=1.0, feature_layers=[0.5, 1.0])
ROWS = {
    "pretrain_lora": {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": True,
                      "ebft": {**STRIDED, "use_whitening": True, "embed_method": "last_token"},
                      "datasets": "pretrain"},
    "structured_full": {"ebft": {**STRIDED, "embed_method": "mean_pooling", "advantage_estimator": "group_norm",
                                 "top_p": 0.9, "ce_coef": 0.1, "min_completion_prefix": 2}, "datasets": "structured"},
}
LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2}}
METRICS = ("ebft/rl_loss", "ebft/mean_reward", "ebft/alignment", "ebft/diversity", "ebft/cfm_loss",
           "ebft/advantages_std", "ebft/num_blocks")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ebft_strided")
    data = write_model_and_data(root, n=48)
    lines = [json.loads(x)["text"] for x in open(data["text"])]
    records = [{"input": lines[i][:30], "output": lines[i + 1]} for i in range(0, 40, 2)]
    (root / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    entries = {"pretrain": [{"path": data["text"], "type": "ebft_pretrain.transform"}],
               "structured": [{"path": str(root / "code.jsonl"), "type": "ebft_strided_structured.transform"}]}
    common = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "special_tokens": {"pad_token": "<pad>"}}
    rows = {row: {**common, **keys, "datasets": entries[keys["datasets"]]} for row, keys in ROWS.items()}
    return run_rows(root, rows, LAYOUTS, {"gradient_accumulation_steps": 4})  # the same micro-batches


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_strided_ebft_matches_one_process(runs, row, layout):
    got, want = logged(runs / f"{row}_{layout}"), logged(runs / f"{row}_ref")
    assert len(got) == len(want) == BASE["max_steps"]
    for key in ("loss", "grad_norm", *METRICS, *(("ebft/ce_loss", "ebft/anchor_offset") if "structured" in row
                                                 else ())):
        a, b = torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=key)
    tensors, ref_tensors = saved_tensors(runs / f"{row}_{layout}"), saved_tensors(runs / f"{row}_ref")
    assert set(tensors) == set(ref_tensors) and tensors
    worst = max((tensors[k] - v).abs().max().item() for k, v in ref_tensors.items())
    print(f"ebft strided {row} {layout}: losses {[r['loss'] for r in got]} rewards "
          f"{[r['ebft/mean_reward'] for r in got]} tensor diff {worst:.1e}")
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("row", list(ROWS))
def test_the_rows_train_something(runs, row):
    """Not a vacuous row: rollouts differ within a block (advantages are not all 0), the loss moves the model."""
    want = logged(runs / f"{row}_ref")
    assert all(r["ebft/advantages_std"] > 1e-3 for r in want), want
    assert all(r["grad_norm"] > 0 for r in want), want
    assert all(r["ebft/num_blocks"] >= 2 for r in want), want
