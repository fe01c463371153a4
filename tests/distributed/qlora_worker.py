"""Rank program for the QLoRA parity rows: train every (model, bits, layout) given, write rank 0's results.

Usage (under torchrun): qlora_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"models": {key: dir}, "recipe": {...}, "samples": {...},
            "runs": [[model key, bits (4 | 8), {config kwargs}, result name], ...]}
Besides losses, norms and the final adapter state it records the bytes this rank holds in quantized base weights,
in other parameters and in optimizer state.
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from qlora_recipe import qlora_model

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.models.quantized import quantized_params
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, train_layout


def _bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    recipe, samples = Recipe(**spec["recipe"]), make_samples(**spec["samples"])
    for model_key, bits, layout, name in spec["runs"]:
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        result = train_layout(accelerator, plugin, None, samples, recipe, model=qlora_model(spec["models"][model_key],
                                                                                             bits))
        quantized = {id(p) for p in quantized_params(result.model)}
        params = list(result.model.parameters())
        memory = {"quantized": sum(_bytes(p) for p in params if id(p) in quantized),
                  "other": sum(_bytes(p) for p in params if id(p) not in quantized),
                  "optimizer": sum(_bytes(v) for s in result.optimizer.optimizer.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0)}
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, result.losses)
        if dist.get_rank() == 0:
            spread = max(abs(a - b) for losses in every_rank for a, b in zip(losses, result.losses))
            adapter = {k: v for k, v in result.state.items() if "lora_" in k}
            torch.save({"losses": result.losses, "norms": result.norms, "state": adapter, "rank_spread": spread,
                        "memory": memory}, f"{out_dir}/{name}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
