"""Start N local ranks of a Python script with torchrun, with a wall-clock limit that kills them all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """End torchrun and every rank. Each rank leads its own session, so killing torchrun's process group misses
    them; torchrun's agent, sent SIGTERM, stops its ranks itself. SIGKILL if it does not in time."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def launch(script: str, nprocs: int, args: list[str] = (), *, timeout: float = 600, env: dict | None = None,
           capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nprocs`` local ranks (gloo on CPU: one thread per rank); raise on failure or timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not _has_cuda():
        full_env["ACCELERATE_USE_CPU"] = "true"  # Accelerator() on a CPU-only machine then uses gloo ranks
    full_env.update(env or {})
    kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if capture else {}
    proc = subprocess.Popen(cmd, env=full_env, start_new_session=True, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, _ = proc.communicate()
        raise TimeoutError(f"{nprocs} ranks of {script} did not finish within {timeout:.0f}s\n{out or ''}")
    except BaseException:  # e.g. Ctrl-C: the ranks run in their own session, so the terminal's SIGINT misses them
        _stop(proc)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{nprocs} ranks of {script} failed with exit code {proc.returncode}\n{out or ''}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def launch_for_result(script: str, nprocs: int, args: list[str] = (), **kwargs):
    """Run ``script`` on ``nprocs`` ranks with ``--worker --result FILE`` appended, and return the JSON rank 0
    wrote to FILE. The shape every benchmark shares: the parent launches itself as the ranks."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="nd_parallel_result_") as tmp:
        result = Path(tmp) / "result.json"
        launch(script, nprocs, [*args, "--worker", "--result", str(result)], **kwargs)
        return json.loads(result.read_text())
