"""`rl: grpo` / `rl: gdpo` through `nd-parallel train` (cli/train/grpo.py: TRL's GRPOTrainer): a user transform
makes chat prompts, two user reward functions score the completions, and FSDP2 and DDP equal one process on the
global batch: the same completions (every logged reward and completion length), every loss, every saved tensor.

Rows: GDPO (normalize_then_sum, weights [1, 2]) with LoRA and beta 0.05 (the reference is the base with the adapter
disabled), and GRPO full fine-tuning with beta 0.05 (TRL's own frozen reference copy) and loss_type grpo. Each step
generates 8 completions (micro_batch_size 2 x dp 2 x gradient_accumulation_steps 2) of 4 prompts, 2 per prompt.

Why they can be equal: completions are sampled with noise keyed by (seed, round, the row's place in the global
generation batch, the position), so one process and each layout draw the same tokens; TRL gathers the rewards over
the ranks and its losses sum over the global batch. Tolerance: what differs is fp32 reduction order and left-padding
lengths (a rank pads its prompts to its own longest): rewards and lengths rtol 1e-6 (atol 1e-6: a whitened pair's
diversity is 0 up to fp32 noise), loss atol 1e-6 (GRPO's loss is a difference of advantage-weighted log-ratios around
0), grad norms rtol 1e-5, saved tensors atol 1e-5 (AdamW, epsilon 1e-6). EBFT rows: its feature-matching reward
(Axolotl's ebft_opencode records), LoRA with whitening and use_vllm: true (transformers generates; vLLM's
stop_token_ids end completions), and full fine-tuning (a frozen copy reads the features).
"""

import json
import textwrap

import pytest
import torch

from tests.distributed.train_yaml_helpers import (
    jobs_for,
    layout_yamls,
    logged,
    run_jobs,
    saved_tensors,
    write_model_and_data,
    write_yaml,
)

REWARDS = textwrap.dedent('''
    """Reward functions and a prompt transform for the GRPO tests, in the form Axolotl documents."""


    def prompts(cfg, dataset_idx=0):
        def row(example, tokenizer=None):
            assert tokenizer is not None  # Axolotl passes the tokenizer to a row function that takes it
            return {"prompt": [{"role": "system", "content": "answer briefly"},
                               {"role": "user", "content": example["question"]}], "answer": example["answer"]}
        return row, {"remove_columns": ["question"]}


    def _text(completion):
        return completion[0]["content"] if isinstance(completion, list) else completion


    def vowels(prompts, completions, **kwargs):
        return [sum(c in "aeiou" for c in _text(x)) / max(1, len(_text(x))) for x in completions]


    def overlap(prompts, completions, answer, **kwargs):
        return [len(set(_text(x).split()) & set(a.split())) / 4.0 for x, a in zip(completions, answer)]
''')
BASE = dict(micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
            lr_scheduler="linear", seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, sequence_len=64,
            val_set_size=0.0)
TRL = dict(max_completion_length=8, num_generations=2, temperature=0.9, top_p=0.95,
           reward_funcs=["tiny_rewards.vowels", "tiny_rewards.overlap"], reward_weights=[1.0, 2.0],
           use_vllm=False, log_completions=False, scale_rewards=True)
EBFT_TRL = dict(max_completion_length=8, num_generations=2, temperature=1.0, use_vllm=True, loss_type="grpo",
                epsilon=0.2, generation_kwargs={"stop_token_ids": [5]})  # vLLM's stop ids: an end token here
ROWS = {
    "gdpo_lora": {"rl": "gdpo", "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True,
                  "val_set_size": 8, "eval_steps": 2,
                  "trl": {**TRL, "beta": 0.05, "multi_objective_aggregation": "normalize_then_sum"}},
    "grpo_full": {"rl": "grpo", "trl": {**TRL, "beta": 0.05, "loss_type": "grpo"}},
    # Axolotl's async trainer: each step samples with the policy of the step before (grpo_async.py)
    "grpo_async": {"rl": "grpo", "trl": {**TRL, "beta": 0.05, "loss_type": "grpo", "async_prefetch": True}},
    # EBFT (structured): the feature-matching reward against each record's ground truth, Axolotl's built-in
    # ebft_opencode transform (input / output records)
    "ebft_lora": {"rl": "ebft", "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True,
                  "ebft": {"feature_layers": [0.5, 1.0], "embed_method": "last_token", "use_whitening": True},
                  "trl": EBFT_TRL, "datasets": "opencode"},
    "ebft_full": {"rl": "ebft", "ebft": {"embed_method": "completion_mean", "diversity_coef": 0.5},
                  "trl": {**EBFT_TRL, "use_vllm": False}, "datasets": "opencode"},
}
REWARDS_OF = {"ebft_lora": ("rewards/feature_matching/mean", "ebft/alignment", "ebft/diversity", "ebft/cfm_loss"),
              "ebft_full": ("rewards/feature_matching/mean", "ebft/alignment", "ebft/diversity", "ebft/cfm_loss")}
LAYOUTS = {"fsdp2": ({"dp_shard_size": 2}, 2), "ddp": ({"dp_replicate_size": 2}, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    data = write_model_and_data(root, n=48)
    lines = [json.loads(x)["text"] for x in open(data["text"])]
    records = [{"question": lines[i][:40], "answer": lines[i + 1][:30]} for i in range(0, 40, 2)]
    (root / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code = [{"input": r["question"], "output": r["answer"], "id": i} for i, r in enumerate(records)]
    (root / "opencode.jsonl").write_text("".join(json.dumps(r) + "\n" for r in code))
    entries = {"opencode": [{"path": str(root / "opencode.jsonl"), "type": "ebft_opencode.transform"}]}
    (root / "tiny_rewards.py").write_text(REWARDS)  # next to the YAMLs: imported from the YAML's folder
    parallel, refs = [], []
    for row, keys in ROWS.items():
        shared = {**BASE, **keys, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
                  "datasets": entries.get(keys.get("datasets"),
                                          [{"path": str(root / "questions.jsonl"), "type": "tiny_rewards.prompts"}])}
        layouts = {f"{row}_{name}": spec for name, spec in LAYOUTS.items()}
        p, r = layout_yamls(root, shared, layouts, dps=(2,))
        refs += [write_yaml(root / f"{row}_ref.yaml", {**json.loads(r[0].read_text()),
                                                        "output_dir": str(root / f"{row}_ref")})]
        parallel += p
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2)
    return root


REWARD_KEYS = ("reward", "reward_std", "rewards/vowels/mean", "rewards/overlap/mean", "completions/mean_length")


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_matches_one_process(runs, row, layout):
    got, want = logged(runs / f"{row}_{layout}"), logged(runs / f"{row}_ref")
    assert len(got) == len(want) == BASE["max_steps"]
    for key in REWARDS_OF.get(row, REWARD_KEYS):  # the same completions, scored the same
        a, b = torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want])
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=key)
    losses, ref = torch.tensor([r["loss"] for r in got]), torch.tensor([r["loss"] for r in want])
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-6)
    norms, ref_norms = torch.tensor([r["grad_norm"] for r in got]), torch.tensor([r["grad_norm"] for r in want])
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)  # dp x too large if the ranks' losses summed
    if ROWS[row].get("val_set_size"):  # evaluation generates too: the same completions, scored the same
        got_eval, want_eval = logged(runs / f"{row}_{layout}", "eval_log.jsonl"), logged(runs / f"{row}_ref",
                                                                                         "eval_log.jsonl")
        assert [r["step"] for r in got_eval] == [r["step"] for r in want_eval] == [2, 3]
        for key in ("eval_loss", *(f"eval_{k}" for k in REWARDS_OF.get(row, REWARD_KEYS))):
            a, b = torch.tensor([r[key] for r in got_eval]), torch.tensor([r[key] for r in want_eval])
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=key)
    tensors, ref_tensors = saved_tensors(runs / f"{row}_{layout}"), saved_tensors(runs / f"{row}_ref")
    assert set(tensors) == set(ref_tensors) and tensors
    worst = max((tensors[k] - v).abs().max().item() for k, v in ref_tensors.items())
    print(f"grpo {row} {layout}: losses {losses.tolist()} rewards {[r['reward'] for r in got]} tensor diff {worst:.1e}")
    assert worst <= 1e-5, worst


def test_async_prefetch_samples_with_the_previous_steps_policy(runs):
    """The async row is grpo_full with async_prefetch: step 0 samples with the initial weights in both, so its
    rewards are equal; step 1 samples with the initial weights again (the policy at the start of step 0) where
    grpo_full samples with the updated ones, so they differ; and its loss reads the sampler's old log-probs (PPO's
    ratio is not 1: the clipped ratio metrics are logged by TRL only off-policy, so compare the losses)."""
    sync, stale = logged(runs / "grpo_full_ref"), logged(runs / "grpo_async_ref")
    assert sync[0]["reward"] == stale[0]["reward"] and sync[0]["loss"] == stale[0]["loss"]
    assert any(a["reward"] != b["reward"] for a, b in zip(sync[1:], stale[1:])), (sync, stale)


@pytest.mark.parametrize("row", list(ROWS))
def test_the_rewards_change_and_differ_within_groups(runs, row):
    """Not a vacuous row: completions differ within a group (else every advantage is 0) and the model moved."""
    want = logged(runs / f"{row}_ref")
    assert all(r["reward_std"] > 0 for r in want), want
    assert len({round(r["completions/mean_length"], 3) for r in want} | {0}) >= 2
