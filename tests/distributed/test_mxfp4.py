"""gpt-oss trained from its MXFP4 checkpoint form with `nd-parallel train` (test YAML gpt_oss_mxfp4_fsdp2.yml:
model_quantization_config: Mxfp4Config, dequantize: true): FSDP2, TP2, EP2, CP2 and PP2 on 2 CPU ranks vs one
process.

The checkpoint is a tiny gpt-oss whose expert weights were packed into MXFP4 blocks and scales
(nd_parallel/testing/mxfp4.py). The test YAML's keys are kept (gradient checkpointing, fsdp_config, the schedule);
the paths, 3 steps and the layout are set here (PP2: 2 samples per micro-batch, no accumulation). The references run
in one process: the MXFP4 checkpoint on the same global batches (micro_batch_size doubled for dp 2), and the same
model saved in full precision with its expert weights on the FP4 grid, which a dequantizing load must equal
exactly. Compared: every logged loss (rtol 1e-5) and the saved model (atol 1e-5); the saved model holds plain
expert weights (no blocks or scales).
"""

import json
from pathlib import Path

import pytest
import torch
import yaml

from nd_parallel.testing.models import make_text, save_tiny_model
from tests.distributed.train_yaml_helpers import jobs_for, logged, run_jobs, saved_tensors, write_yaml

YAML = Path(__file__).resolve().parent.parent / "axolotl_configs" / "gpt_oss_mxfp4_fsdp2.yml"
PP_BATCH = {"micro_batch_size": 2, "gradient_accumulation_steps": 1}  # PP's 2 micro-batches need 2 samples a step
# layout -> (its keys, its one-process reference); dp 2 layouts compare with micro_batch_size doubled
LAYOUTS = {"fsdp2": ({}, "ref2"), "tp2": ({"tensor_parallel_size": 2}, "ref1"), "ep2": ({"ep_size": 2}, "ref2"),
           "cp2": ({"context_parallel_size": 2}, "ref1"), "pp2": ({"pipeline_parallel_size": 2, **PP_BATCH}, "ref_pp")}
REFS = {"ref1": {}, "ref2": {"micro_batch_size": 2}, "ref_pp": PP_BATCH}
MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def _write_models(root: Path, lines: list[str]) -> dict[str, Path]:
    """models/gpt_oss (full precision), models/gpt_oss_mxfp4 (its experts packed), models/gpt_oss_grid (the full
    precision model with its expert weights on the FP4 grid), each with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    from nd_parallel.testing.mxfp4 import save_mxfp4_checkpoint
    from nd_parallel.testing.tokenizer import train_tiny_tokenizer

    models = {name: root / "models" / name for name in ("gpt_oss", "gpt_oss_mxfp4", "gpt_oss_grid")}
    save_tiny_model("gpt_oss", models["gpt_oss"], seed=1, **MOE)
    train_tiny_tokenizer(lines).save_pretrained(models["gpt_oss"])
    on_grid = save_mxfp4_checkpoint(models["gpt_oss"], models["gpt_oss_mxfp4"])
    model = AutoModelForCausalLM.from_pretrained(models["gpt_oss"], dtype=torch.float32)
    model.load_state_dict(on_grid, strict=False)
    model.save_pretrained(models["gpt_oss_grid"])
    train_tiny_tokenizer(lines).save_pretrained(models["gpt_oss_grid"])
    return models


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    lines = make_text(240, seed=3)
    models = _write_models(root, lines)
    chats = [{"messages": [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 1]}]}
             for i in range(0, 240, 2)]
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    base = yaml.safe_load(YAML.read_text())
    base.update(base_model=str(models["gpt_oss_mxfp4"]), max_steps=3, dataset_prepared_path=str(root / "prepared"),
                datasets=[{"path": str(root / "chat.jsonl"), "type": "chat_template"}])
    parallel, refs = [], []
    for layout, (sizes, _) in LAYOUTS.items():
        parallel.append(write_yaml(root / f"{layout}.yml", {**base, **sizes, "output_dir": str(root / layout)}))
    for name, keys in REFS.items():
        refs.append(write_yaml(root / f"{name}.yml", {**base, **keys, "output_dir": str(root / name)}))
    grid = {k: v for k, v in base.items() if not k.startswith("model_quantization")}
    refs.append(write_yaml(root / "grid.yml", {**grid, "base_model": str(models["gpt_oss_grid"]),
                                               "output_dir": str(root / "grid")}))
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2)
    return root


def test_dequantized_checkpoint_trains_as_its_fp4_grid_model(runs):
    """One process: the MXFP4 checkpoint read with dequantize trains exactly as the full-precision model whose expert
    weights are on the FP4 grid (the values the blocks hold), and saves plain expert weights."""
    losses, grid = [r["loss"] for r in logged(runs / "ref1")], [r["loss"] for r in logged(runs / "grid")]
    assert losses == grid and len(losses) == 3, (losses, grid)
    tensors = saved_tensors(runs / "ref1")
    assert not [k for k in tensors if k.endswith(("_blocks", "_scales"))]
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32
    for key, value in saved_tensors(runs / "grid").items():
        assert torch.equal(tensors[key], value), key


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mxfp4_checkpoint_matches_one_process(runs, layout):
    got, ref = runs / layout, runs / LAYOUTS[layout][1]
    losses, ref_losses = [r["loss"] for r in logged(got)], [r["loss"] for r in logged(ref)]
    assert [r["step"] for r in logged(got)] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    tensors, ref_tensors = saved_tensors(got), saved_tensors(ref)
    assert set(tensors) == set(ref_tensors) and tensors
    worst = max((tensors[k] - v).abs().max().item() for k, v in ref_tensors.items())
    print(f"mxfp4 {layout}: losses {losses} max loss rel diff "
          f"{max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)):.2e} saved-tensor diff {worst:.2e}")
    assert worst <= 1e-5
