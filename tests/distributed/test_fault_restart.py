"""`nd-parallel train --max-restarts 1` with `kill -9` of one rank mid-run: torchrun's elastic agent stops the other
rank, restarts both, they resume from the latest complete checkpoint (resume_from_checkpoint: auto), the log says
how many steps were lost, and the final weights equal an uninterrupted run's bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from nd_parallel.fault.proctree import alive, descendants
from tests.distributed.train_yaml_helpers import write_model_and_data

YAML = """base_model: {model}
datasets:
  - path: {text}
    type: completion
sequence_len: 32
micro_batch_size: 2
max_steps: 30
learning_rate: 0.001
lr_scheduler: linear
logging_steps: 1
save_steps: 3
output_dir: {out}
dp_shard_size: 2
resume_from_checkpoint: auto
hang_timeout: {hang}
"""


def _train(tmp_path: Path, data: dict, name: str, kill_at: int | None = None,
           hang: float = 0) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / name
    cfg = tmp_path / f"{name}.yml"
    cfg.write_text(YAML.format(model=data["model"], text=data["text"], out=out, hang=hang))
    proc = subprocess.Popen([sys.executable, "-m", "nd_parallel.cli", "train", str(cfg), "--max-restarts", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    measured = {}
    if kill_at is not None:
        log = out / "train_log.jsonl"
        deadline = time.time() + 300
        while not (log.is_file() and len(log.read_text().splitlines()) >= kill_at):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.02)
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_text() for p in descendants(proc.pid)}
        ranks = sorted(p for p, cmd in cmdlines.items() if "nd_parallel.cli.train.rank" in cmd and "torch.distributed.run" not in cmd)
        assert len(ranks) == 2, cmdlines
        victim, other = ranks[-1], ranks[0]
        measured["killed_after_step"] = len(log.read_text().splitlines())
        t0 = time.time()
        measured["killed_at"] = time.strftime("%H:%M:%S", time.localtime(t0)) + f".{int(t0 % 1 * 1000):03d}"
        os.kill(victim, signal.SIGKILL)
        while alive(other):
            time.sleep(0.05)
        measured["other_rank_stopped_s"] = round(time.time() - t0, 2)
        cut = False  # the restarted run cuts the log back to the checkpoint's step, then logs the next step
        while proc.poll() is None and "restart_to_first_step_s" not in measured:
            n = len(log.read_text().splitlines()) if log.is_file() else 0
            cut = cut or n < measured["killed_after_step"]
            if cut and n > 3:
                measured["restart_to_first_step_s"] = round(time.time() - t0, 2)
            time.sleep(0.02)
    text = proc.communicate(timeout=600)[0]
    return subprocess.CompletedProcess(proc.args, proc.returncode, text), measured


def test_killed_rank_restarts_and_resumes_exactly(tmp_path):
    data = write_model_and_data(tmp_path, n=400)
    reference, _ = _train(tmp_path, data, "uninterrupted")
    assert reference.returncode == 0, reference.stdout[-3000:]
    run, measured = _train(tmp_path, data, "restarted", kill_at=5)
    assert run.returncode == 0, run.stdout[-4000:]
    print(f"restart: {measured}; " + next(line for line in run.stdout.splitlines() if "steps lost" in line))
    assert measured["other_rank_stopped_s"] < 10
    note = next(line for line in run.stdout.splitlines() if "restart 1: resuming from checkpoint-" in line)
    assert "steps lost" in note
    log = [json.loads(line) for line in (tmp_path / "restarted" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 31))  # one line per step, the lost ones logged once again
    ref_log = [json.loads(line) for line in (tmp_path / "uninterrupted" / "train_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log] == [r["loss"] for r in ref_log]
    a = load_file(str(tmp_path / "uninterrupted" / "model.safetensors"))
    b = load_file(str(tmp_path / "restarted" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_with_save_on_signal_writes_a_trainer_checkpoint(tmp_path):
    """SIGTERM to `nd-parallel train` (what SLURM sends before it kills): with save_on_signal the Trainer saves
    checkpoint-<step> after the current step on every rank, and no process is left."""
    from nd_parallel.fault.resume import complete_checkpoints

    data = write_model_and_data(tmp_path, n=400)
    out = tmp_path / "out"
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(YAML.format(model=data["model"], text=data["text"], out=out, hang=0)
                   .replace("max_steps: 30", "max_steps: 100000").replace("save_steps: 3", "save_steps: 100000")
                   + "save_on_signal: true\n")
    proc = subprocess.Popen([sys.executable, "-m", "nd_parallel.cli", "train", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = out / "train_log.jsonl"
    deadline = time.time() + 300
    while not (log.is_file() and len(log.read_text().splitlines()) >= 5):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    tree = descendants(proc.pid)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=60)[0]
    took = time.time() - sent
    while any(alive(p) for p in tree):
        assert time.time() - sent < 30, [p for p in tree if alive(p)]
        time.sleep(0.1)
    saved = complete_checkpoints(out)
    print(f"save_on_signal (Trainer): {saved[-1].name if saved else None} written, {len(tree)} processes gone "
          f"{took:.1f} s after SIGTERM")
    assert proc.returncode != 0 and took < 30, text[-3000:]
    assert len(saved) == 1 and int(saved[0].name.split("-")[1]) >= 5, text[-3000:]
