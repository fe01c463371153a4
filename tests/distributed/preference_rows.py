"""The TRL preference-trainer rows' shared launch (test_dpo.py, test_kto.py): every row of a trainer in one 2-rank
launch of preference_worker.py, and each row's one-process reference (per-device batch = the row's global batch),
all references in ONE process, keyed by (dp size, extras)."""

import json
import subprocess
import sys

import pytest
import torch

WORKER = "tests/distributed/preference_worker.py"
WORLD = 2
# The TRL arguments every trainer's rows share (each test adds its loss's own, e.g. beta)
BASE_ARGS = dict(gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                 adam_epsilon=1e-6, weight_decay=0.01, seed=0, lr_scheduler_type="linear", max_grad_norm=1.0,
                 max_length=48, bf16=False)


def lora_and_full(layouts: dict) -> dict:
    """{name: layout} -> rows "<name>_lora" (a LoRA adapter) and "<name>_full" (full fine-tuning) of each layout."""
    return {f"{name}_{kind}": (layout, {"lora": True} if kind == "lora" else {})
            for name, layout in layouts.items() for kind in ("lora", "full")}


def row_fixtures(kind: str, rows: dict, base: dict, per_rank: int, reference_extras: dict | None = None):
    """The module fixtures ``run`` (the rows' one launch) and ``references`` (row -> its one-process results)."""
    @pytest.fixture(scope="module")
    def run(tiny_model, launch_worker):
        return launch_rows(launch_worker, f"{kind}_2r", kind, tiny_model("llama"), rows, base, per_rank)

    @pytest.fixture(scope="module", name="references")
    def refs(tiny_model, memo, worker_env, tmp_path_factory):
        return references(kind, tiny_model("llama"), rows, base, per_rank, memo, worker_env, tmp_path_factory,
                          reference_extras)

    return run, refs


def dp_of(config: dict) -> int:
    return WORLD // (config.get("tp_size", 1) * config.get("cp_size", 1))


def trl_args(base: dict, per_rank: int) -> dict:
    return dict(base, per_device_train_batch_size=per_rank, per_device_eval_batch_size=per_rank)


def launch_rows(launch_worker, name: str, kind: str, model: str, rows: dict, base: dict, per_rank: int):
    spec = {"trainer": kind, "model": model,
            "runs": [[row, config, trl_args(base, per_rank), extras] for row, (config, extras) in rows.items()]}
    return launch_worker(name, WORKER, WORLD, spec)


def references(kind: str, model: str, rows: dict, base: dict, per_rank: int, memo, worker_env, tmp_path_factory,
               reference_extras: dict | None = None):
    """row -> its one-process run's results; ``reference_extras`` are added to every reference's extras."""
    def key(row):
        config, extras = rows[row]
        return json.dumps([dp_of(config), extras], sort_keys=True)

    def run_all():
        out = tmp_path_factory.mktemp(f"{kind}_ref")
        keys = sorted({key(r) for r in rows})
        runs = [[f"ref{i}", None, trl_args(base, per_rank * json.loads(k)[0]),
                 {**json.loads(k)[1], **(reference_extras or {})}] for i, k in enumerate(keys)]
        (out / "spec.json").write_text(json.dumps({"trainer": kind, "model": model, "runs": runs}))
        subprocess.run([sys.executable, WORKER, str(out), str(out / "spec.json")], check=True, capture_output=True,
                       env={**worker_env, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"})
        return {k: torch.load(out / f"ref{i}.pt", weights_only=True) for i, k in enumerate(keys)}

    return lambda row: memo(kind, run_all)[key(row)]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
