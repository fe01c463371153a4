"""ReLoRA on a 4-bit base (Axolotl's relora.yml: `adapter: qlora` + `load_in_4bit` + `relora` with
`adamw_bnb_8bit`) through `nd-parallel train`: FSDP2, DDP and PP2 equal one process on the global batch, and the run
ends with the merged float model, as Axolotl's does.

5 steps, restarts before steps 2 and 4 (jagged_restart_steps 2): each merges B @ A x scaling into the layer's float
weight (read from the checkpoint, then from the previous restart's fp16 copy under output_dir/relora_base), quantizes
the sum to NF4 again, starts a new adapter and prunes every moment (lora_r 64: each factor has 4096 values or more,
so bitsandbytes keeps its moments as 8-bit codes, sharded by FSDP2 on 256-value block boundaries) (relora_prune_ratio
1.0: a partial pruning leaves AdamW ill-conditioned where exp_avg_sq was zeroed and exp_avg kept, test_restarts.py
derives it). Tolerance: losses and grad norms rtol 1e-5 (fp32 reduction order; the NF4 codes are the same on every
rank: each quantizes the same float sum); the merged float model is written in fp16 (Axolotl's dtype), so tensors
atol 1e-4: one fp16 step at the weights' magnitude (below 0.125 here: 2^-14 = 6.1e-5 at most) where fp32 noise
crosses a rounding boundary.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.train_yaml_helpers import (
    jobs_for,
    logged,
    run_jobs,
    saved_tensors,
    write_model_and_data,
    write_yaml,
)

BASE = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=5, learning_rate=1e-2, lr_scheduler="linear",
            seed=0, optimizer="adamw_bnb_8bit", adam_epsilon=1e-6, sequence_len=32, val_set_size=0.0,
            adapter="qlora", load_in_4bit=True, lora_r=64, lora_alpha=128, lora_dropout=0.0, lora_target_linear=True,
            relora=True, jagged_restart_steps=2, relora_prune_ratio=1.0, bnb_config_kwargs={
                "bnb_4bit_compute_dtype": "float32"})
LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "ddp": {"dp_replicate_size": 2},
           "pp2": {"pipeline_parallel_size": 2, "pp_microbatches": 2}}  # PP: each stage merges its own layers
REF = {"fsdp2": "ref2", "ddp": "ref2", "pp2": "ref1"}  # one process on the same global batch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("relora_qlora")
    data = write_model_and_data(root, n=48)
    shared = {**BASE, "base_model": data["model"], "dataset_prepared_path": str(root / "prepared"),
              "datasets": [{"path": data["text"], "type": "completion"}]}
    parallel = [write_yaml(root / f"{name}.yaml", {**shared, **sizes, "output_dir": str(root / name)})
                for name, sizes in LAYOUTS.items()]
    refs = [write_yaml(root / f"ref{dp}.yaml", {**shared, "micro_batch_size": 2 * dp, "output_dir": str(
        root / f"ref{dp}")}) for dp in (1, 2)]
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2)
    return root, data["model"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_relora_on_a_4bit_base_matches_one_process(runs, layout):
    root, _ = runs
    got, want = logged(root / layout), logged(root / REF[layout])
    assert len(got) == len(want) == BASE["max_steps"]
    for key in ("loss", "grad_norm"):
        a, b = torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0, msg=key)
    assert sorted(p.name for p in (root / layout / "relora_base").iterdir()) == ["step-2", "step-4", "step-6"]
    tensors, ref_tensors = saved_tensors(root / layout), saved_tensors(root / REF[layout])
    assert set(tensors) == set(ref_tensors) and tensors
    worst = max((tensors[k].float() - v.float()).abs().max().item() for k, v in ref_tensors.items())
    print(f"relora qlora {layout}: losses {[r['loss'] for r in got]} merged-model diff {worst:.1e}")
    assert worst <= 1e-4, worst


def test_the_run_ends_with_the_merged_float_model(runs):
    """The output is a float checkpoint (no quantization_config) with every tensor of the base; the adapted
    weights moved by the merged deltas, the others are the base's; each restart left its fp16 copies."""
    root, model = runs
    out = root / "ref2"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    merged, base = saved_tensors(out), load_file(f"{model}/model.safetensors")
    assert set(merged) == set(base)
    adapted = [k for k in base if k.endswith(("q_proj.weight", "down_proj.weight"))]
    assert adapted and all(merged[k].dtype == torch.float16 for k in adapted)
    # moved by the deltas: each by at least 3e-4 somewhere, 5 fp16 steps (6.1e-5 at these magnitudes) and far below
    # NF4's level spacing (~0.1 x a block's absmax ~ 8e-3), which is why the merge goes through the float weights
    assert all((merged[k].float() - base[k].half().float()).abs().max() > 3e-4 for k in adapted)
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])
    assert sorted(p.name for p in (out / "relora_base").iterdir()) == ["step-2", "step-4", "step-6"]
