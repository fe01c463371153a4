"""`llama4_linearized_experts` (nd_parallel/models/llama4_linear.py) through `nd-parallel train` on a tiny Llama 4
text model: a stock checkpoint (fused experts, split after loading) fully fine-tuned, and a linearized checkpoint
(experts.gate_projs.N, built as it loads) with LoRA on the routed experts' Linears, each under two layouts vs one
process on the global batch. Tolerances as the other `nd-parallel train` parity rows (losses rtol 1e-5, saved
tensors atol 1e-5): nothing is rounded, only the reduction order differs."""

import shutil

import pytest
import torch

from nd_parallel.testing.models import save_tiny_model
from tests.distributed.train_yaml_helpers import compare_runs, jobs_for, run_jobs, write_model_and_data, write_yaml

BASE = dict(sequence_len=96, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
            lr_scheduler="linear", seed=0, optimizer="adamw_torch", bf16="auto", llama4_linearized_experts=True)
LORA = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0,
            lora_target_modules=r".*\.(q_proj|v_proj|experts\.gate_projs\.[0-9]+|experts\.down_projs\.[0-9]+)$")
# variant -> (checkpoint, extra keys, layouts)
VARIANTS = {"fused_full": ("fused", {}, {"fsdp2": ({"dp_shard_size": 2}, 2),
                                         "pp2": ({"pipeline_parallel_size": 2}, 1)}),
            "linear_lora": ("linear", LORA, {"fsdp2": ({"dp_shard_size": 2}, 2),
                                              "cp2": ({"context_parallel_size": 2}, 1)})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from nd_parallel.models.llama4_linear import linearize_experts

    root = tmp_path_factory.mktemp("llama4_linear")
    data = write_model_and_data(root, n=48)
    fused = save_tiny_model("llama4_text", root / "fused", seed=1)
    model = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32)
    assert linearize_experts(model) == 2
    model.save_pretrained(root / "linear")
    for name in ("fused", "linear"):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (root / "model" / f).exists():
                shutil.copy(root / "model" / f, root / name / f)
    parallel, refs = [], []
    for variant, (checkpoint, keys, layouts) in VARIANTS.items():
        shared = {**BASE, **keys, "base_model": str(root / checkpoint), "dataset_prepared_path": str(root / "prep"),
                  "datasets": [{"path": data["text"], "type": "completion"}]}
        for layout, (sizes, _) in layouts.items():
            parallel.append(write_yaml(root / f"{variant}-{layout}.yaml",
                                       {**shared, **sizes, "output_dir": str(root / f"{variant}-{layout}")}))
        for dp in sorted({dp for _, dp in layouts.values()}):
            refs.append(write_yaml(root / f"{variant}-ref{dp}.yaml", {**shared, "micro_batch_size": 2 * dp,
                                                                     "output_dir": str(root / f"{variant}-ref{dp}")}))
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2)
    return root


CASES = [(v, lay) for v, (_, _, layouts) in VARIANTS.items() for lay in layouts]


@pytest.mark.parametrize("variant,layout", CASES, ids=[f"{v}-{lay}" for v, lay in CASES])
def test_matches_one_process(runs, variant, layout):
    dp = VARIANTS[variant][2][layout][1]
    losses, tensors = compare_runs(runs / f"{variant}-{layout}", runs / f"{variant}-ref{dp}", rtol=1e-5, atol=1e-5,
                                   label=f"llama4 {variant} {layout}")
    assert len(losses) == 3
    # the experts are Linears in what was saved: per-expert weights (full), LoRA on them (adapter)
    needle = "experts.gate_projs.3." + ("lora_B" if "lora" in variant else "weight")
    assert any(needle in k for k in tensors), sorted(tensors)[:8]
