"""benchmarks/gpu_one.py --dry-run: the one-GPU script runs end to end on CPU at tiny sizes and prints its table.

No test may need a GPU; this one checks that a single run on a GPU machine will not die on a path the CPU can
take: every training row (plain transformers, the bf16 + chunked-loss recipe, compile, selective and full
checkpointing) trains the same model from the same first loss, the ring kernel with one cp block matches SDPA, and
``cp_backend="torch"`` reaches torch's context-parallel SDPA dispatcher (which has no CPU kernel) and restores
``F.scaled_dot_product_attention`` afterwards.
"""

import sys
from pathlib import Path

import pytest
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_one  # noqa: E402


def test_dry_run_prints_every_row(capsys):
    sdpa = F.scaled_dot_product_attention
    lines = gpu_one.main(["--dry-run"])
    table = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines if line.startswith("| ")}
    losses = []
    for name in gpu_one.RECIPES:
        cells = table[name]
        assert float(cells[0]) > 0, (name, cells)  # a step time, not a failure message
        losses.append(float(cells[-1].rstrip(" |")))
    # The same random init and batch: every recipe starts from the same loss (bf16 matmuls: within 1e-3).
    assert max(losses) - min(losses) < 1e-3 * losses[0], losses
    ring = table["ring kernel, cp=1 (one block; math on CUDA, flash_cpu on CPU)"]
    assert float(ring[1].rstrip(" |")) < 2e-2, ring  # bf16 inputs: SDPA rounds differently, ~2^-7 relative
    torch_cp = table['cp_backend="torch", one-rank mesh']
    assert "sharding strategy" in torch_cp[1], torch_cp  # torch's CP dispatcher was entered (CUDA kernels only)
    assert F.scaled_dot_product_attention is sdpa
    assert "| training |" in capsys.readouterr().out


def test_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(gpu_one.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--dry-run"):
        gpu_one.main([])
