"""Scripts written for Accelerate's ND parallelism run under nd_parallel with one import changed, from
``accelerate launch --config_file`` with an Accelerate-format YAML, and match one process.

Our copies of Accelerate's two example scripts (examples/accelerate_nd_parallel/: the plain loop and the Trainer
script) run under FSDP2, TP2, CP2 and PP2 in one ``accelerate launch`` on 2 CPU ranks (configs/fsdp2.yaml: its
parallelism_config and fsdp_config keys, activation checkpointing on, cpu_ram_efficient_loading at the launcher's
default), and under FSDP2xTP2 in one on 4 ranks (configs/fsdp2_tp2.yaml). Each script runs unchanged; the rows after
the first get their layout the way the scripts read it: the loop from its command line (pp from
PARALLELISM_CONFIG_PP_SIZE, which Accelerate's script has no flag for), the Trainer script from PARALLELISM_CONFIG_*
(a launch file's section). The references are the same scripts in one process on the layout's global batch.
Compared: the loop's loss every step and the Trainer's logged loss and grad norm every step (rtol 1e-5), and the
saved weights at the end (atol 1e-5). The loop's TP rows load the model with ``from_pretrained(tp_plan="auto",
device_mesh=accelerator.torch_device_mesh)`` and the Trainer script's with ``device_mesh=pc.build_device_mesh(...)``
and ``TrainingArguments(parallelism_config=pc)``: transformers shards it at load and nd_parallel gathers it back and
applies its own plan.

What CPU, gloo and exact comparison force, beyond the import (listed in the scripts' docstrings too):
  - ACCELERATE_USE_CPU=true: accelerate's multi-process launcher does not tell CPU ranks to use the CPU;
  - fp32 (--precision fp32), so the loss can be compared at rtol 1e-5 (the scripts default to bf16, as Accelerate's);
  - the Trainer script: --learning-rate 1e-3 (so 4 steps lower the loss) and --adam-epsilon 1e-6 (see TRAINER_ARGS);
  - the loop averages its loss with SUM / size: gloo has no ReduceOp.AVG;
  - --device-type cpu for the Trainer script: torch.accelerator names no device on a CPU machine;
  - pp_microbatches=1 and pp_schedule="gpipe" for PP2: the scripts' batch is one sample per rank, and 1F1B needs
    at least pp_size micro-batches;
  - FSDP2xTP2 loop: --tp-without-size, since transformers 5.24 ignores device_mesh and refuses a tp_size below the
    world size (it then shards over all 4 ranks; nd_parallel gathers that back);
  - the loop saves with accelerator.save_model (a pipeline stage has no save_pretrained).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from nd_parallel.fault.launch import free_port
from nd_parallel.testing.launch import LaunchOnce

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "accelerate_examples_worker.py"
CONFIGS = ROOT / "examples" / "accelerate_nd_parallel" / "configs"
LOOP, TRAINER = "nd_parallel_loop.py", "nd_parallel_trainer.py"
STEPS = 4
LOOP_ARGS = ["--num-steps", str(STEPS), "--precision", "fp32", "--lr", "0.1", "--sequence-length", "32",
             "--checkpoint-frequency", "2", "--save-dir", "{out}", "--log-json", "{out}/log.json"]
# AdamW with eps=1e-6, as every parity recipe here (nd_parallel/testing/parity.py Recipe.adam_eps says why: at 1e-8
# fp32 reduction-order noise in a gradient of ~1e-8 moves one weight by ~2e-5; measured here too: an o_proj element
# under CP2, 2.6e-5, while every loss and grad norm agreed to 1e-5).
TRAINER_ARGS = ["--max-steps", str(STEPS), "--learning-rate", "1e-3", "--adam-epsilon", "1e-6", "--precision", "fp32",
                "--sequence-length", "32", "--device-type", "cpu", "--checkpoint-frequency", "2", "--save-dir", "{out}",
                "--log-json", "{out}/log.json"]
SIZES = ("DP_REPLICATE_SIZE", "DP_SHARD_SIZE", "TP_SIZE", "CP_SIZE", "PP_SIZE")
# One sample per rank is one micro-batch, and 1F1B needs at least pp_size of them: GPipe.
PP_ONE_SAMPLE = {"PARALLELISM_CONFIG_PP_MICROBATCHES": "1", "PARALLELISM_CONFIG_PP_SCHEDULE": "gpipe"}


def _layout(**sizes) -> dict:
    """PARALLELISM_CONFIG_* for a Trainer-script row (unset: 1), as a launch file's parallelism_config writes them."""
    env = {f"PARALLELISM_CONFIG_{k}": str(sizes.get(k.lower(), 1)) for k in SIZES}
    return {**env, **(PP_ONE_SAMPLE if sizes.get("pp_size", 1) > 1 else dict.fromkeys(PP_ONE_SAMPLE))}


# launch -> (config file, ranks, [(row, script, extra argv, env, dp)])
LAUNCHES = {
    "2r": ("fsdp2.yaml", 2, [
        ("loop_fsdp2", LOOP, ["--dp-shard-size", "2"], {}, 2),
        ("trainer_fsdp2", TRAINER, [], {}, 2),
        ("loop_tp2", LOOP, ["--tp-size", "2"], {}, 1),
        ("trainer_tp2", TRAINER, [], _layout(tp_size=2), 1),
        ("loop_cp2", LOOP, ["--cp-size", "2"], {"PARALLELISM_CONFIG_CP_COMM_STRATEGY": "allgather"}, 1),
        ("trainer_cp2", TRAINER, [], _layout(cp_size=2), 1),
        ("loop_pp2", LOOP, [], {"PARALLELISM_CONFIG_PP_SIZE": "2", **PP_ONE_SAMPLE,
                                "PARALLELISM_CONFIG_CP_COMM_STRATEGY": None}, 1),
        ("trainer_pp2", TRAINER, [], _layout(pp_size=2), 1),
    ]),
    "4r": ("fsdp2_tp2.yaml", 4, [
        ("loop_fsdp2_tp2", LOOP, ["--dp-shard-size", "2", "--tp-size", "2", "--tp-without-size"], {}, 2),
        ("trainer_fsdp2_tp2", TRAINER, [], {}, 2),
    ]),
}
ROWS = [(launch, row) for launch, (_, _, rows) in LAUNCHES.items() for row, *_ in rows]
_DONE = LaunchOnce()


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARALLELISM_CONFIG_", "FSDP_", "ACCELERATE_"))}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
            "ACCELERATE_USE_CPU": "true"}


def _spec(out: Path, runs: list) -> Path:
    path = out / "spec.json"
    path.write_text(json.dumps({"runs": runs}))
    return path


def _run(cmd: list, env: dict, timeout: int) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-8000:]}")


@pytest.fixture(scope="module")
def launched(tiny_model, tmp_path_factory):
    """launch name -> output directory: every row of the launch, run by `accelerate launch --config_file`."""
    def start(name):
        config, ranks, rows = LAUNCHES[name]
        out = tmp_path_factory.mktemp(f"accelerate_examples_{name}")
        model = tiny_model("llama")
        runs = [[row, script, [*argv, *(LOOP_ARGS if script == LOOP else TRAINER_ARGS), "--model-name", model], env]
                for row, script, argv, env, _ in rows]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
               "--main_process_port", str(free_port()), str(WORKER), str(out), str(_spec(out, runs))]
        _run(cmd, _clean_env(), timeout=1500)
        return out

    return lambda name: _DONE.get(name, lambda: start(name))


@pytest.fixture(scope="module")
def references(tiny_model, tmp_path_factory):
    """One process, both scripts, each data-parallel degree: (script, dp) -> output directory."""
    def start():
        out = tmp_path_factory.mktemp("accelerate_examples_ref")
        model = tiny_model("llama")
        runs = []
        for dp in (1, 2):
            runs.append([f"loop_dp{dp}", LOOP, [*LOOP_ARGS, "--batch-size", str(dp), "--model-name", model], {}])
            runs.append([f"trainer_dp{dp}", TRAINER,
                         [*TRAINER_ARGS, "--per-device-batch-size", str(dp), "--model-name", model], {}])
        _run([sys.executable, str(WORKER), str(out), str(_spec(out, runs))], _clean_env(), timeout=900)
        return out

    return lambda script, dp: _DONE.get("ref", start) / f"{'loop' if script == LOOP else 'trainer'}_dp{dp}"


def _weights(directory: Path) -> dict:
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    return {k: v for f in files for k, v in load_file(f).items()}


@pytest.mark.parametrize("launch,row", ROWS, ids=[r for _, r in ROWS])
def test_accelerate_example_matches_one_process(launch, row, launched, references):
    _, _, rows = LAUNCHES[launch]
    _, script, _, _, dp = next(r for r in rows if r[0] == row)
    out, ref = launched(launch) / row, references(script, dp)
    got, want = (json.loads((d / "log.json").read_text()) for d in (out, ref))
    assert len(got["losses"]) == len(want["losses"]) == STEPS
    for key in ("losses", "norms") if script == TRAINER else ("losses",):
        for a, b in zip(got[key], want[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], want[key])
    assert want["losses"][-1] < want["losses"][0]
    final = (out / "final", ref / "final") if script == LOOP else (out, ref)
    a, b = (_weights(d) for d in final)
    assert set(a) == set(b)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in b)
    assert diff <= 1e-5, diff
    print(f"{row}: {got['config']}; losses {got['losses']}; weights max diff {diff:.2e}")


def test_the_loop_sees_accelerates_attributes(launched):
    log = json.loads((launched("2r") / "loop_tp2" / "log.json").read_text())
    assert log["mesh"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]  # accelerator.torch_device_mesh is ours
    assert log["config"].startswith("pp=1 dp_replicate=1 dp_shard=1 cp=1 tp=2")
    fsdp2 = json.loads((launched("2r") / "trainer_fsdp2" / "log.json").read_text())
    assert "activation_checkpointing=full" in fsdp2["config"]  # fsdp_activation_checkpointing: true took effect
    # TrainingArguments(parallelism_config=ours), no callback: Accelerator() found the Trainer building it
    assert all(json.loads((launched(launch) / row / "log.json").read_text())["adopted"]
               for launch, (_, _, rows) in LAUNCHES.items() for row, script, *_ in rows if script == TRAINER)
