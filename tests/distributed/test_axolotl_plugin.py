"""Real `axolotl train` (axolotl==0.19.0, in .venv-axolotl: .ci/axolotl-venv) with the nd_parallel plugin.

A tiny local Llama + tokenizer and a completion dataset; one plain Axolotl process (`--launcher python`) is the
reference. The same YAML with `plugins: [nd_parallel.plugins.axolotl.NDParallelAxolotlPlugin]` runs on two CPU ranks
(`--launcher torchrun -- --nproc_per_node 2`) under FSDP2 (dp_shard_size: 2, micro_batch_size halved: the same
global batches) and under PP2 (pipeline_parallel_size: 2, which Axolotl alone does not have). A test-only plugin
(axolotl_recorder.py) writes each run's unrounded log_history and the layout nd_parallel applied. Compared: every
logged loss and grad norm (rtol 1e-5) and the final model.safetensors (atol 1e-5).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.distributed.train_yaml_helpers import saved_tensors, write_model_and_data

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("ND_PARALLEL_AXOLOTL_VENV", ROOT / ".venv-axolotl"))
RECORDER = "tests.distributed.axolotl_recorder.LossRecorder"
PLUGIN = "nd_parallel.plugins.axolotl.NDParallelAxolotlPlugin"

_MISSING = None if (VENV / "bin" / "axolotl").is_file() else (
    f"no Axolotl virtual environment at {VENV}: build it with .ci/axolotl-venv (installs axolotl==0.19.0 with the CPU "
    "torch; .ci/run does it) or point ND_PARALLEL_AXOLOTL_VENV at one")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module", autouse=True)
def _axolotl_venv():
    """In CI (CI=true, .ci/run sets it) a missing venv fails every test here, naming why; elsewhere they skip, and
    the reason is printed."""
    if _MISSING is None:
        return
    if _in_ci():
        pytest.fail(f"CI: {_MISSING} (.ci/axolotl-venv printed the step that failed)", pytrace=False)
    pytest.skip(_MISSING)  # the reason is printed at the end of the run (tests/conftest.py)


BASE = dict(tokenizer_type="AutoTokenizer", val_set_size=0, sequence_len=64, sample_packing=False,
            gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, lr_scheduler="linear",
            optimizer="adamw_torch", weight_decay=0.01, seed=0, tf32=False, logging_steps=1, save_strategy="no")
RUNS = {  # name -> (launcher args, YAML keys)
    "ref": (["--launcher", "python"], dict(micro_batch_size=4, bf16=False, fp16=False, plugins=[RECORDER])),
    # bf16: auto on CPU would be fp16 in plain Axolotl 0.19 (and crash); the plugin turns it into fp32
    "fsdp2": (["--launcher", "torchrun", "--", "--nproc_per_node", "2"],
              dict(micro_batch_size=2, bf16="auto", dp_shard_size=2, plugins=[PLUGIN, RECORDER])),
    "pp2": (["--launcher", "torchrun", "--", "--nproc_per_node", "2"],
            dict(micro_batch_size=4, bf16=False, fp16=False, pipeline_parallel_size=2, plugins=[PLUGIN, RECORDER])),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("axolotl")
    data = write_model_and_data(root, n=96)
    env = {**os.environ, "AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}  # the recorder plugin is imported from tests/
    env.pop("VIRTUAL_ENV", None)
    for name, (launcher, keys) in RUNS.items():
        cfg = {**BASE, **keys, "base_model": data["model"], "output_dir": str(root / name),
               "dataset_prepared_path": str(root / "prepared"),
               "datasets": [{"path": data["text"], "type": "completion"}]}
        path = root / f"{name}.yml"
        path.write_text(json.dumps(cfg))
        proc = subprocess.run([str(VENV / "bin" / "axolotl"), "train", str(path), *launcher], cwd=root, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return root


def _record(root, name):
    return json.loads((root / name / "log_history.json").read_text())


@pytest.mark.parametrize("name,layout", [("fsdp2", "dp_shard=2"), ("pp2", "pp=2")])
def test_axolotl_with_plugin_matches_plain_axolotl(runs, name, layout):
    ref, got = _record(runs, "ref"), _record(runs, name)
    assert ref["layout"] is None and ref["processes"] == 1  # plain Axolotl, one process
    assert layout in got["layout"] and got["processes"] == 2
    steps = [h for h in got["log_history"] if "loss" in h]
    ref_steps = [h for h in ref["log_history"] if "loss" in h]
    assert [h["step"] for h in steps] == [h["step"] for h in ref_steps] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([h[key] for h in steps]), torch.tensor([h[key] for h in ref_steps]),
                                   rtol=1e-5, atol=0)
    assert ref_steps[-1]["loss"] < ref_steps[0]["loss"]
    tensors, ref_tensors = saved_tensors(runs / name), saved_tensors(runs / "ref")
    assert set(tensors) == set(ref_tensors)
    worst = max((tensors[k] - v).abs().max().item() for k, v in ref_tensors.items())
    print(f"axolotl {name}: losses {[h['loss'] for h in steps]} vs {[h['loss'] for h in ref_steps]}, "
          f"model diff {worst:.2e}")
    assert worst <= 1e-5
