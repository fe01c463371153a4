"""Rank program for the LISA / ReLoRA parity rows: train every (kind, option, layout) given, write rank 0's results.

Usage (under torchrun): restarts_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"model": dir, "recipe": {...}, "samples": {...}, "runs": [[name, "lisa" | "relora", {option},
            {config kwargs}], ...]}
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from restarts_recipe import lisa_hook, lora_model, relora_hook

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, train_layout


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    samples = make_samples(**spec["samples"])
    for name, kind, option, layout in spec["runs"]:
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        model = lora_model(spec["model"], plugin) if kind == "relora" else None
        moments = {}
        hook = lisa_hook(**option) if kind == "lisa" else relora_hook(**option, moments=moments)
        recipe = Recipe(**{**spec["recipe"], "steps": option.get("steps", spec["recipe"]["steps"])})
        result = train_layout(accelerator, plugin, spec["model"], samples, recipe, model=model, before_step=hook)
        every_moments = [None] * dist.get_world_size()  # under PP each stage holds its own layers' moments
        dist.all_gather_object(every_moments, {k: v.cpu() for k, v in moments.items()})
        frozen = sum(1 for p in result.model.parameters() if not p.requires_grad)
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, result.losses)
        if dist.get_rank() == 0:
            spread = max(abs(a - b) for losses in every_rank for a, b in zip(losses, result.losses))
            torch.save({"losses": result.losses, "norms": result.norms, "state": result.state, "rank_spread": spread,
                        "frozen": frozen,
                        "moments": {k: v for m in every_moments for k, v in m.items()}}, f"{out_dir}/{name}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
