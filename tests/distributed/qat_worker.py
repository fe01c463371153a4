"""Rank program for the QAT parity rows: train every (QAT options, layout) given, write rank 0's results.

Usage (under torchrun): qat_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"model": dir, "recipe": {...}, "samples": {...}, "runs": [[name, {qat options}, {config kwargs}], ...]}
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from qat_recipe import qat_model, switch

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, train_layout


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    samples = make_samples(**spec["samples"])
    for name, options, layout in spec["runs"]:
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        model = qat_model(spec["model"], options, plugin)
        result = train_layout(accelerator, plugin, spec["model"], samples, Recipe(**spec["recipe"]),
                              progress=switch(model, options), model=model)
        fake = sum(hasattr(m, "weight_fake_quantizer") for m in result.model.modules())
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, result.losses)
        if dist.get_rank() == 0:
            spread = max(abs(a - b) for losses in every_rank for a, b in zip(losses, result.losses))
            torch.save({"losses": result.losses, "norms": result.norms, "state": result.state, "rank_spread": spread,
                        "fake_layers": fake}, f"{out_dir}/{name}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
