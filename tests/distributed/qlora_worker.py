"""Rank program for the QLoRA parity rows: train every (model, bits, layout) given, write rank 0's results.

Usage (under torchrun): qlora_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"models": {key: dir}, "recipe": {...}, "samples": {...}, "quantize_experts": bool (optional),
            "runs": [[model key, bits (4 | 8 | 0), {config kwargs}, result name, {recipe overrides}?], ...]}
bits 0: the unquantized model, fully fine-tuned (the 8-bit optimizer rows: recipe override optim="adamw_8bit").
Besides losses, norms and the final adapter state (every parameter for bits 0) it records the bytes this rank holds
in quantized base weights, in other parameters and in optimizer state; for a bitsandbytes optimizer stepping local
shards, also rank 0's 8-bit state of each shard (codes and block absmax) and whether its ends fall on blocks.
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


def _shard_states(result) -> dict:
    """HF name -> (aligned, {state key: this rank's tensor}) for an optimizer stepping local shards."""
    from nd_parallel.distributed.optimizer_8bit import shard_alignment

    optimizer = result.optimizer.optimizer
    names = {id(p): n for n, p in result.model.named_parameters()}
    return {names[id(p)]: (shard_alignment(p), {k: v.clone() for k, v in optimizer.state[local].items()
                                                 if isinstance(v, torch.Tensor) and v.dim() > 0})
            for p, local in getattr(optimizer, "nd_parallel_local_shards", [])}


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    samples = make_samples(**spec["samples"])
    for model_key, bits, layout, name, *overrides in spec["runs"]:
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        run_recipe = Recipe(**{**spec["recipe"], **(overrides[0] if overrides else {})})
        model_dir = spec["models"][model_key]
        result = train_layout(accelerator, plugin, model_dir, samples, run_recipe,
                              model=qlora_model(model_dir, bits, spec.get("quantize_experts", False)) if bits else None)
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
            adapter = {k: v for k, v in result.state.items() if "lora_" in k or not bits}
            torch.save({"losses": result.losses, "norms": result.norms, "state": adapter, "rank_spread": spread,
                        "memory": memory, "shard_states": _shard_states(result)}, f"{out_dir}/{name}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
