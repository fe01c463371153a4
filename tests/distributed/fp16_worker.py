"""Rank program for test_fp16.py's one-rank overflow rows: only rank 1 finds an inf in its own gradients; every
rank must skip that step and back off the scale alike.

Usage (under torchrun): fp16_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"model": dir, "runs": [{"name", "layout", "clip": bool}]}. Saves OUT_DIR/NAME.pt from rank 0:
{"ranks": [per rank: {"skipped": [...], "scales": [...], "moved": [did this rank's parameters change, per step]}]}.
A run with "resume": true also saves the state after its steps and loads it under a fresh Accelerator (whose
scaler starts elsewhere): "resumed" = that scaler's state_dict, "saved" = the first one's.
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import GradScalerKwargs, gather_object
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, _collate, optimizer_and_schedule

POISONED_STEP = 1


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _poison(optimizer) -> None:
    """One element of this rank's first local gradient becomes inf (a real fp16 overflow, on this rank alone)."""
    grad = next(_local(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
    grad.view(-1)[0] = float("inf")


def _prepared(run: dict, model_dir: str, init_scale: float):
    AcceleratorState._reset_state(reset_partial_state=False)
    scaler = GradScalerKwargs(init_scale=init_scale, growth_interval=2)
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[scaler])
    plugin = NDParallelPlugin(ParallelismConfig(**run["layout"])).attach(accelerator)
    model = plugin.from_pretrained(model_dir)
    recipe = Recipe(steps=3, per_rank_batch=run["per_rank_batch"])
    opt, sched = optimizer_and_schedule(model, recipe)
    loader = DataLoader(make_samples(n=24, seq_len=16), batch_size=recipe.per_rank_batch, collate_fn=_collate)
    return (accelerator, recipe, *accelerator.prepare(model, opt, loader, sched))


def run_one(run: dict, model_dir: str, out_dir: str) -> dict:
    accelerator, recipe, model, opt, loader, sched = _prepared(run, model_dir, 1024.0)
    record = {"skipped": [], "scales": [], "moved": []}
    for step, batch in zip(range(recipe.steps), loader):
        before = [_local(p).detach().clone() for g in opt.param_groups for p in g["params"]]
        accelerator.backward(model(**batch).loss)
        if step == POISONED_STEP and dist.get_rank() == 1:
            _poison(opt)
        if run["clip"]:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        after = [_local(p).detach() for g in opt.param_groups for p in g["params"]]
        record["moved"].append(any(not torch.equal(a, b) for a, b in zip(after, before)))
        record["skipped"].append(opt.step_was_skipped)
        record["scales"].append(accelerator.scaler.get_scale())
    if run.get("resume"):
        accelerator.save_state(f"{out_dir}/{run['name']}_ckpt")
        record["saved"] = accelerator.scaler.state_dict()
        resumed = _prepared(run, model_dir, 2.0 ** 20)[0]
        resumed.load_state(f"{out_dir}/{run['name']}_ckpt")
        record["resumed"] = resumed.scaler.state_dict()
    return {"ranks": gather_object([record])}


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    for run in spec["runs"]:
        saved = run_one(run, spec["model"], out_dir)
        if dist.get_rank() == 0:
            torch.save(saved, f"{out_dir}/{run['name']}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
