"""Rank program for the LoRA parity rows: train every (family, layout, model path) given, write rank 0's results.

Usage (under torchrun): peft_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"models": {key: dir}, "recipe": {...}, "samples": {...},
            "runs": [[model key, {config kwargs}, "wrap" | "load", result name, {extras}], ...]}
extras: "save_at": k and "ckpt": dir -> accelerator.save_state(dir) after step k (training goes on);
"resume": dir -> accelerator.load_state(dir) right after prepare; "adapter" / "merged": dir -> save_model at the end.
Besides losses, norms and the final state it records, on every rank, what a frozen base must not cost: any
gradient or optimizer state on a frozen parameter, and the bytes of parameters + gradients + optimizer state;
for the memory-efficient "load" path, the adapter values it initialised (rank 0's, which prepare gives every rank).
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from peft_recipe import initial_adapter, layout_model, optimizer_and_schedule
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, _collate


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def run(accelerator, plugin, model_dir, how, samples, recipe, extras):
    model = layout_model(plugin, model_dir, how)
    init = initial_adapter(model) if how == "load" else None  # what the one-process reference starts from
    opt, sched = optimizer_and_schedule(model, recipe)
    loader = DataLoader(samples, batch_size=recipe.per_rank_batch, collate_fn=_collate)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    start = 0
    if "resume" in extras:
        start = accelerator.load_state(extras["resume"])["optimizer_step"]
    losses, norms, frozen_grads = [], [], 0
    for step, batch in enumerate(loader, start):
        if step == recipe.steps:
            break
        out = model(**batch)
        accelerator.backward(out.loss)
        frozen_grads += sum(1 for p in model.parameters() if not p.requires_grad and p.grad is not None)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), recipe.max_norm)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        if step + 1 == extras.get("save_at"):  # after the step: the checkpoint's next batch is batch `save_at`
            accelerator.save_state(extras["ckpt"])
    params = list(model.parameters())
    frozen_state = sum(1 for p in params if not p.requires_grad and opt.optimizer.state.get(p))
    state_bytes = sum(_local_bytes(v) for s in opt.optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
    memory = {"params": sum(_local_bytes(p) for p in params),
              "trainable": sum(_local_bytes(p) for p in params if p.requires_grad), "optimizer": state_bytes}
    if "adapter" in extras:
        accelerator.save_model(model, extras["adapter"])
    if "merged" in extras:
        accelerator.save_model(model, extras["merged"], merge_adapter=True)
    return losses, norms, accelerator.get_state_dict(model), frozen_grads, frozen_state, memory, init


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    recipe = Recipe(**spec["recipe"])
    samples = make_samples(**spec["samples"])
    for model_key, layout, how, result_name, extras in spec["runs"]:
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        losses, norms, state, frozen_grads, frozen_state, memory, init = run(
            accelerator, plugin, spec["models"][model_key], how, samples, recipe, extras)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (losses, frozen_grads, frozen_state, memory))
        if dist.get_rank() == 0:
            spread = max(abs(a - b) for other in gathered for a, b in zip(other[0], losses))
            torch.save({"losses": losses, "norms": norms, "state": state, "rank_spread": spread,
                        "frozen_grads": sum(g[1] for g in gathered), "frozen_state": sum(g[2] for g in gathered),
                        "memory": [g[3] for g in gathered], "adapter_init": init}, f"{out_dir}/{result_name}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
