"""Checkpoints reshard between expert-parallel and non-expert-parallel layouts (DCP, HF names).

A tiny Mixtral (4 experts) trains under ep2 x FSDP2 (experts split over ep and sharded over the dp ranks left) and
FSDP4 on 4 ranks, each on its own order of the data, and saves; fresh runs of each layout then resume their own checkpoint and load every other one. As in
test_checkpoint.py, a checkpoint moves bytes: every comparison is bit-exact. One launch does both phases
(checkpoint_worker.py's, run back to back by ep_checkpoint_worker.py).
"""

import pytest
import torch

from nd_parallel.testing.models import save_tiny_model

WORKER = "tests/distributed/ep_checkpoint_worker.py"
STEPS = 2
LAYOUTS = {"ep2_fsdp2": dict(dp_shard_size=4, ep_size=2), "fsdp4": dict(dp_shard_size=4)}
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def out(launch_worker, tmp_path_factory):
    def spec(out_dir):
        model = save_tiny_model("mixtral", out_dir / "model", num_local_experts=4, num_experts_per_tok=2)
        return {"model": str(model), "samples": dict(n=24, seq_len=16), "steps": STEPS, "per_rank": 2,
                "ckpt": str(out_dir / "ckpt"), "out": str(out_dir), "save": list(LAYOUTS), "load": list(LAYOUTS),
                "checkpoints": list(LAYOUTS),
                "layouts": {n: {"config": c, "resume": True, "export": None, "shift": 3 * i}
                            for i, (n, c) in enumerate(LAYOUTS.items())}}

    return launch_worker("ep_checkpoint", WORKER, 4, spec)


def _load(out, kind, name):
    return torch.load(out / f"{kind}_{name}.pt", weights_only=True)


@pytest.mark.parametrize("source", list(LAYOUTS))
@pytest.mark.parametrize("target", list(LAYOUTS))
def test_reshard_between_ep_and_not(source, target, out):
    want = _load(out, "save", source)["state"]
    got = _load(out, "load", target)[source]["state"]
    assert set(got) == set(want)
    # Experts are saved whole, under their HF names: [num_experts, 2 * intermediate, hidden].
    assert tuple(want[f"model.{EXPERTS}"].shape) == (4, 256, 64)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} tensors differ after loading {source} under {target}, e.g. {bad[:4]}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_is_exact(name, out):
    saved = _load(out, "save", name)
    assert _load(out, "load", name)["resumed"] == saved["uninterrupted"][STEPS:]
