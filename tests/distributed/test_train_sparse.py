"""Axolotl's LLM Compressor plugin (sparse fine-tuning, cli/train/sparsity.py) through `nd-parallel train`: a tiny
Llama pruned 2:4 on its projections, fine-tuned with the ConstantPruningModifier recipe Axolotl's example uses,
under FSDP2 and TP2 vs one process on the global batch; the pruned entries stay exactly zero in every run, and the
same YAML without the plugin loses them (so the masks are what keeps them).

Tolerance: the masks are elementwise on each rank's piece and exact (a product by 0 or 1), so a layout's run
differs from one process only by the fp32 reduction order of a full fine-tune (~1e-7 relative): loss rtol 1e-5,
parameters atol 1e-5, the full fine-tuning parity rows' bounds (measured: see the printed gaps). AdamW's epsilon is
1e-6: with the default 1e-8 one TP2 entry, whose gradient is at the noise level, took a visibly different normalized
step (1.1e-5 apart; every other entry <= 4e-8); epsilon bounds that amplification by 1/epsilon.
"""

import pytest
import torch

from tests.distributed.train_yaml_helpers import (
    compare_runs,
    jobs_for,
    layout_yamls,
    run_jobs,
    saved_tensors,
    write_model_and_data,
    write_yaml,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RECIPE = {"finetuning_stage": {"finetuning_modifiers": {"ConstantPruningModifier": {
    "targets": [f"re:.*{t}.weight" for t in TARGETS], "start": 0}}}}
BASE = dict(sequence_len=96, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
            lr_scheduler="linear", seed=0, optimizer="adamw_torch", adam_epsilon=1e-6, bf16="auto",
            plugins=["axolotl.integrations.llm_compressor.LLMCompressorPlugin"],
            llmcompressor={"recipe": RECIPE, "save_compressed": False})
LAYOUTS = {"fsdp2": ({"dp_shard_size": 2}, 2), "tp2": ({"tensor_parallel_size": 2}, 1)}


def _prune_2_of_4(model_dir) -> None:
    """Zero the 2 smallest of every 4 consecutive entries of each targeted weight (2:4 sparsity), in place."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(f"{t}.weight" in name for t in TARGETS):
                groups = param.view(-1, 4)
                smallest = groups.abs().argsort(dim=1)[:, :2]
                groups.scatter_(1, smallest, 0.0)
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse")
    data = write_model_and_data(root, n=48)
    _prune_2_of_4(data["model"])
    shared = {**BASE, "base_model": data["model"], "datasets": [{"path": data["text"], "type": "completion"}],
              "dataset_prepared_path": str(root / "prepared")}
    parallel, refs = layout_yamls(root, shared, LAYOUTS)
    plain = {k: v for k, v in shared.items() if k not in ("plugins", "llmcompressor")}
    refs.append(write_yaml(root / "plain.yaml", {**plain, "output_dir": str(root / "plain")}))
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2)
    return root, data["model"]


def _zeros(model_dir) -> dict[str, torch.Tensor]:
    """The pruned entries of the checkpoint: name -> boolean mask of its zeros (targeted weights only)."""
    return {k: v == 0 for k, v in saved_tensors(model_dir).items() if any(f"{t}.weight" in k for t in TARGETS)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sparse_finetuning_matches_one_process(runs, layout):
    root, _ = runs
    dp = LAYOUTS[layout][1]
    losses, _ = compare_runs(root / layout, root / f"ref{dp}", rtol=1e-5, atol=1e-5, label=f"sparse {layout}")
    assert len(losses) == 3


@pytest.mark.parametrize("run", ["ref1", "ref2", *LAYOUTS])
def test_the_pruned_entries_stay_zero_and_the_others_train(runs, run):
    root, base = runs
    pruned, before, after = _zeros(base), saved_tensors(base), saved_tensors(root / run)
    assert len(pruned) == 14 and all(m.float().mean() == 0.5 for m in pruned.values())  # 2:4, both layers
    for name, zeros in pruned.items():
        assert torch.equal(after[name][zeros], torch.zeros(int(zeros.sum()))), name
        assert (after[name][~zeros] != before[name][~zeros]).float().mean() > 0.9, name


def test_without_the_plugin_the_zeros_are_lost(runs):
    root, base = runs
    after = saved_tensors(root / "plain")
    lost = [float((after[name][zeros] != 0).float().mean()) for name, zeros in _zeros(base).items()]
    assert min(lost) > 0.9, lost
