"""Run a script in Axolotl 0.19's own virtual environment (.venv-axolotl, built by .ci/axolotl-venv) and read the
JSON it prints last: how the unit tests compare our tokenization and schedules with Axolotl's own code. Without that
venv a test skips, except under CI, where it fails (the venv is part of the build)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AXOLOTL_PYTHON = Path(os.environ.get("ND_PARALLEL_AXOLOTL_VENV", ROOT / ".venv-axolotl")) / "bin" / "python"


def run_in_axolotl(*args: str, timeout: float = 300):
    """``python ARGS...`` in Axolotl's venv (no PYTHONPATH of ours, no telemetry); the last stdout line as JSON."""
    if not AXOLOTL_PYTHON.is_file():
        why = f"no Axolotl interpreter at {AXOLOTL_PYTHON}: build .venv-axolotl (.ci/axolotl-venv)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"CI: {why}", pytrace=False)
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"AXOLOTL_DO_NOT_TRACK": "1",
                                                                          "DO_NOT_TRACK": "1"}
    out = subprocess.run([str(AXOLOTL_PYTHON), *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
