"""Rank program for the QLoRA parity rows: train every (model, bits, layout) given, write rank 0's results.

Usage (under torchrun): qlora_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"models": {key: dir}, "recipe": {...}, "samples": {...}, "quantize_experts": bool (optional),
            "runs": [[model key, bits (4 | 8 | 0), {config kwargs}, result name, {recipe overrides}?, {extras}?], ...]}
bits 0: the unquantized model, fully fine-tuned (the 8-bit optimizer rows: recipe override optim="adamw_8bit").
extras: "save_at": k and "ckpt": dir -> accelerator.save_state(dir) after step k (training goes on); "resume": dir ->
accelerator.load_state(dir) right after prepare, then the remaining steps (the checkpoint rows; their optimizer also
has an empty parameter group, as the Trainer's no-decay group is under LoRA).
Besides losses, norms and the final adapter state (every parameter for bits 0) it records the bytes this rank holds
in quantized base weights, in other parameters and in optimizer state; for a bitsandbytes optimizer stepping local
shards, also rank 0's 8-bit state of each shard (codes and block absmax) and whether its ends fall on blocks; and a
digest of every quantized byte and quantization statistic this rank holds (its state dict's non-float tensors and
the 4-bit Linears' statistics), to compare the base a resumed run holds with the uninterrupted run's.
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from qlora_recipe import qlora_model

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.models.quantized import quantized_params
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, RunResult, _collate, optimizer_and_schedule, train_layout


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


def _train_with_checkpoint(accelerator, model, samples, recipe, extras) -> RunResult:
    """train_layout's loop, saving after step ``save_at`` or resuming from ``resume`` (its remaining steps)."""
    from torch.utils.data import DataLoader

    opt, _ = optimizer_and_schedule(model, recipe)
    # The Trainer's no-decay group is empty when only LoRA matrices train: a group the checkpoint cannot name.
    opt.add_param_group({"params": [], "weight_decay": 0.0})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * recipe.steps))  # as the recipe's
    loader = DataLoader(samples, batch_size=recipe.per_rank_batch, collate_fn=_collate)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    start = accelerator.load_state(extras["resume"])["optimizer_step"] if "resume" in extras else 0
    result = RunResult()
    for step, batch in enumerate(loader, start):
        if step == recipe.steps:
            break
        out = model(**batch)
        accelerator.backward(out.loss)
        result.norms.append(float(accelerator.clip_grad_norm_(model.parameters(), recipe.max_norm)))
        opt.step()
        sched.step()
        opt.zero_grad()
        result.losses.append(out.loss.item())
        if step + 1 == extras.get("save_at"):  # after the step: the checkpoint's next batch is batch `save_at`
            accelerator.save_state(extras["ckpt"])
    result.state, result.optimizer, result.model = accelerator.get_state_dict(model), opt, model
    return result


def _base_digest(model) -> str:
    """sha256 of this rank's quantized base: every non-float tensor of its state dict (packed 4-bit bytes, int8 rows,
    a 4-bit weight's uint8 absmax, expert int8 rows), the statistics beside them (a 4-bit Linear's ``weight.*``, a
    quantized expert's ``parametrizations.*``) and each 4-bit Linear's offset."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        value = value.to_local() if hasattr(value, "to_local") else value
        statistics = ".weight." in name or ".parametrizations." in name  # a 4-bit Linear's or a quantized expert's
        if isinstance(value, torch.Tensor) and (not value.is_floating_point() or statistics):
            digest.update(name.encode())
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for name, module in sorted(model.named_modules()):
        qs = getattr(module._parameters.get("weight"), "quant_state", None)
        if qs is not None and qs.nested:
            digest.update(f"{name}.offset={float(qs.offset)!r}".encode())
    return digest.hexdigest()


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    samples = make_samples(**spec["samples"])
    for model_key, bits, layout, name, *more in spec["runs"]:
        overrides, extras = (more + [{}, {}])[:2]
        accelerator = Accelerator()
        plugin = NDParallelPlugin(ParallelismConfig(**layout)).attach(accelerator)
        run_recipe = Recipe(**{**spec["recipe"], **overrides})
        model_dir = spec["models"][model_key]
        model = qlora_model(model_dir, bits, spec.get("quantize_experts", False)) if bits else None
        if extras:
            model = model if model is not None else plugin.from_pretrained(model_dir)
            result = _train_with_checkpoint(accelerator, model, samples, run_recipe, extras)
        else:
            result = train_layout(accelerator, plugin, model_dir, samples, run_recipe, model=model)
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
                        "memory": memory, "shard_states": _shard_states(result),
                        "base_digest": _base_digest(result.model) if bits else None}, f"{out_dir}/{name}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
