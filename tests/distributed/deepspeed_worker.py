"""Rank program for the DeepSpeed pipeline parity tests: train every (family, layout) given, write rank 0's results.

Usage (under torchrun, DS_ACCELERATOR=cpu on CPU): deepspeed_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"models": {key: dir}, "runs": [[model key, layout name, {config kwargs}, result name, {data}], ...],
            "recipe": {...}, "samples": {...}}
{data}: {"vary_length": true} shortens every other block of 8 samples by 8 tokens (the activation shape
changes between steps), {"no_mask": true} drops the attention mask; the test's reference uses the same
``shape_data``. {"check_accumulation": true}: afterwards, a second forward without zero_grad must be refused.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, train_layout


def shape_data(samples: list[dict], vary_length: bool = False, no_mask: bool = False,
               check_accumulation: bool = False) -> list[dict]:
    shaped = []
    for i, sample in enumerate(samples):
        cut = sample["input_ids"].shape[0] - 8 if vary_length and (i // 8) % 2 else None
        shaped.append({k: v[:cut] for k, v in sample.items() if not (no_mask and k == "attention_mask")})
    return shaped


def accumulation_refusal(accelerator, samples, recipe) -> str | None:
    """Two forward calls without zero_grad in between (gradient accumulation): the message it is refused with."""
    from nd_parallel.testing.parity import _collate

    model = accelerator._models[-1]
    batch = _collate(samples[: recipe.per_rank_batch])
    model(**batch)
    try:
        model(**batch)
    except NotImplementedError as err:
        return str(err)
    return None


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    recipe = Recipe(**spec["recipe"])
    samples = make_samples(**spec["samples"])
    for model_key, _, layout, result_name, data in spec["runs"]:
        start = time.perf_counter()
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        check = data.get("check_accumulation", False)
        result = train_layout(accelerator, plugin, spec["models"][model_key], shape_data(samples, **data), recipe)
        refused = accumulation_refusal(accelerator, samples, recipe) if check else None
        every_rank = [None] * dist.get_world_size()  # the loss must be the same number on every rank
        dist.all_gather_object(every_rank, result.losses)
        if dist.get_rank() == 0:
            spread = max(abs(a - b) for losses in every_rank for a, b in zip(losses, result.losses))
            torch.save({"losses": result.losses, "norms": result.norms, "state": result.state,
                        "rank_spread": spread, "seconds": time.perf_counter() - start, "refused": refused},
                       f"{out_dir}/{result_name}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
