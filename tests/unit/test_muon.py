"""Axolotl's `optimizer: muon` (nd_parallel/distributed/muon.py): the Newton-Schulz step orthogonalizes, the update is
Axolotl's own Muon's bit for bit (its venv), and the YAML builds it through the Trainer. Under FSDP2 / TP2 / PP2 /
CP2 (whole matrices orthogonalized from their shards): tests/distributed/test_train_yaml_parity.py (completion_muon)."""

import json
import subprocess
import sys

import pytest
import torch

from nd_parallel.distributed.muon import Muon, muon_param_groups, newton_schulz
from tests.unit.axolotl_venv import run_in_axolotl

SHAPES = {"layers.0.q_proj.weight": (24, 16), "layers.0.down_proj.weight": (16, 40), "embed_tokens.weight": (50, 16),
          "lm_head.weight": (50, 16)}
STEPS, LR, WD = 3, 0.02, 0.1

# Run in either venv: seeded parameters and gradients, STEPS steps of the given Muon, the parameters as JSON.
SCRIPT = """
import json, sys, torch
shapes, steps, lr, wd = json.loads(sys.argv[1])
gen = torch.Generator().manual_seed(0)
params = {n: torch.nn.Parameter(torch.randn(*s, generator=gen)) for n, s in shapes.items()}
grads = [{n: torch.randn(*s, generator=gen) for n, s in shapes.items()} for _ in range(steps)]
if sys.argv[2] == "axolotl":
    from axolotl.contribs.mit.muon import Muon
    hidden = [p for n, p in params.items() if "embed" not in n and "lm_head" not in n]
    rest = [p for p in params.values() if all(p is not h for h in hidden)]
    opt = Muon(lr=lr, wd=wd, muon_params=hidden, adamw_params=rest)
else:
    from nd_parallel.distributed.muon import Muon, muon_param_groups
    opt = Muon(muon_param_groups(params.items()), lr=lr, weight_decay=wd, ns_dtype=torch.bfloat16)
for g in grads:
    for n, p in params.items():
        p.grad = g[n].clone()
    opt.step()
print(json.dumps({n: p.detach().flatten().tolist() for n, p in params.items()}))
"""


def test_newton_schulz_orthogonalizes():
    g = torch.randn(32, 20, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(newton_schulz(g, 5).float())
    assert s.min() > 0.5 and s.max() < 1.5, s  # Keller Jordan's quintic: singular values near 1, not exactly
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = torch.nn.functional.cosine_similarity(newton_schulz(g, 5).float().flatten(), (u @ vh).flatten(), dim=0)
    assert cos > 0.95, cos


def test_groups_and_refusals():
    params = {n: torch.nn.Parameter(torch.zeros(*s)) for n, s in SHAPES.items()} | {"norm.weight": torch.nn.Parameter(
        torch.zeros(16)), "experts.gate_up_proj": torch.nn.Parameter(torch.zeros(2, 16, 8))}
    muon, adamw, flat = muon_param_groups(params.items())
    assert (muon["use_muon"], len(muon["params"]), adamw["use_muon"], len(adamw["params"])) == (True, 2, False, 3)
    assert flat == {"params": [params["norm.weight"]], "use_muon": False, "weight_decay": 0.0}
    with pytest.raises(ValueError, match=r"shapes \[\(2, 16, 8\)\] are in a use_muon group"):
        Muon([{"params": [params["experts.gate_up_proj"]], "use_muon": True}])


def test_update_is_axolotls_muon_bit_for_bit(monkeypatch):
    """Axolotl's Muon (axolotl.contribs.mit.muon, Moonlight's) and ours on the same parameters and gradients: the
    same parameters after 3 steps, exactly (2-D hidden matrices by Muon, embeddings and head by its AdamW), with the
    orthogonalization in bf16 as Axolotl computes it (ours: bf16 on CUDA, fp32 on CPU unless ns_dtype says). Axolotl
    torch.compile's its Newton-Schulz; run eagerly here (TORCHDYNAMO_DISABLE), as ours runs: inductor's fused bf16
    kernels round differently from eager bf16 ops, which is a kernel difference, not an algorithm one."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    arg = json.dumps([SHAPES, STEPS, LR, WD])
    theirs = run_in_axolotl("-c", SCRIPT, arg, "axolotl")
    out = subprocess.run([sys.executable, "-c", SCRIPT, arg, "ours"], capture_output=True, text=True, check=True)
    ours = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(ours) == set(theirs)
    for name in SHAPES:
        assert ours[name] == theirs[name], name


def test_yaml_optimizer_muon_passes_and_the_trainer_gets_adamw_args(tmp_path):
    """optimizer: muon passes the config stage; the Trainer's own `optim` stays a name it knows (the rank program
    replaces its create_optimizer: schedules.use_muon)."""
    from nd_parallel.cli.train.config import load_train_config
    from nd_parallel.cli.train.job import trainer_arguments

    path = tmp_path / "c.yml"
    path.write_text("base_model: ./m\ndatasets:\n  - path: ./d.jsonl\n    type: completion\noptimizer: muon\n")
    cfg = load_train_config(path, environ={})
    assert cfg.optimizer == "muon"
    assert trainer_arguments(cfg, "x", train_rows=8, eval_rows=0, dp=1)["optim"] == "adamw_torch"
