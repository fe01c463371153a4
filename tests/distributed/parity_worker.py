"""Rank program for the parity matrix: train every (family, layout) given, write rank 0's results.

Usage (under torchrun): parity_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"models": {key: dir}, "recipe": {...},
            "runs": [[model key, layout name, {config kwargs}, result name, {make_samples kwargs}], ...]}
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.distributed import sequence_parallel
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, train_layout


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    recipe = Recipe(**spec["recipe"])
    made = {}
    for model_key, _, layout, result_name, sample_spec in spec["runs"]:
        key = json.dumps(sample_spec, sort_keys=True)
        samples = made[key] = made.get(key) or make_samples(**sample_spec)
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        result = train_layout(accelerator, plugin, spec["models"][model_key], samples, recipe)
        # The loss must be the same number on every rank, not only on rank 0.
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, result.losses)
        if dist.get_rank() == 0:
            spread = max(abs(a - b) for losses in every_rank for a, b in zip(losses, result.losses))
            torch.save(
                {"losses": result.losses, "norms": result.norms, "state": result.state, "rank_spread": spread,
                 "sequence_parallel": sequence_parallel.applied(result.model)},
                f"{out_dir}/{result_name}.pt",
            )
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
