"""Rank program for the bf16 / activation-checkpointing / evaluation rows: run each spec'd run, save rank 0's view.

Usage (under torchrun, any world size including 1 for the references): precision_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"models": {key: dir}, "runs": [{"name", "model", "layout", "mixed_precision", "samples",
            "recipe", "eval_samples" (optional), "generate" (optional: new tokens)}]}

Every rank checks the dtypes the bf16 recipe promises (fp32 parameters, gradients and AdamW moments; bf16
compute) and the results record any rank where they did not hold.
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.distributed.activation_checkpoint import CheckpointedForward
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, _collate, train_layout


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def dtype_report(model, optimizer, batch, accelerator) -> list[str]:
    """Problems with the dtypes of master weights, gradients and optimizer state on this rank ([] = none)."""
    problems = []
    out = model(**batch)
    accelerator.backward(out.loss)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if _local(p).dtype != torch.float32:
                problems.append(f"parameter {tuple(p.shape)} is {_local(p).dtype}")
            if p.grad is not None and _local(p.grad).dtype != torch.float32:
                problems.append(f"gradient {tuple(p.shape)} is {_local(p.grad).dtype}")
            for key, value in optimizer.state.get(p, {}).items():
                if key != "step" and _local(value).dtype != torch.float32:
                    problems.append(f"optimizer {key} {tuple(p.shape)} is {_local(value).dtype}")
    if not any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        problems.append("no parameter of this rank got a gradient")
    optimizer.zero_grad()
    return problems


def generate(accelerator, model, prompts, new_tokens: int):
    """Greedy tokens for this rank's share of the prompts, gathered over the data-parallel ranks."""
    loader = accelerator.prepare(DataLoader(prompts, batch_size=2, collate_fn=_collate))
    model.eval()
    tokens = []
    with torch.no_grad():
        for batch in loader:
            out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            tokens.append(accelerator.gather_for_metrics(out))
    model.train()
    return torch.cat(tokens).cpu()


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    for run in spec["runs"]:
        recipe = Recipe(**run["recipe"])
        # Accelerate keeps one AcceleratorState per process; runs with another precision need it reset (the
        # process group, PartialState, stays).
        AcceleratorState._reset_state(reset_partial_state=False)
        accelerator = Accelerator(mixed_precision=run.get("mixed_precision", "no"))
        plugin = NDParallelPlugin(ParallelismConfig(**run["layout"])).attach(accelerator)
        samples = make_samples(**run["samples"])
        evals = make_samples(**run["eval_samples"]) if run.get("eval_samples") else None
        model = None
        if run.get("load_dtype"):  # pure low-precision training: the weights themselves in that dtype
            model = plugin.from_pretrained(spec["models"][run["model"]], dtype=getattr(torch, run["load_dtype"]))
        if run.get("hf_gradient_checkpointing"):  # the switch users already know, honoured by prepare
            model = plugin.from_pretrained(spec["models"][run["model"]], memory_efficient=False)
            model.gradient_checkpointing_enable()
        result = train_layout(accelerator, plugin, spec["models"][run["model"]], samples, recipe,
                              eval_samples=evals, model=model)
        # How many decoder layers this rank runs under activation checkpointing: a no-op would also be bit-equal.
        checkpointed = sum(isinstance(m.__dict__.get("forward"), CheckpointedForward) for m in result.model.modules())
        saved = {"losses": result.losses, "norms": result.norms, "state": result.state, "checkpointed": checkpointed,
                 "evals": [(e.step, e.losses, e.logits) for e in result.evals]}
        if run.get("generate"):
            prompts = [{"input_ids": s["input_ids"][:8]} for s in make_samples(n=8, seq_len=8, seed=3, min_len=8)]
            saved["tokens"] = generate(accelerator, result.model, prompts, run["generate"])
        if run.get("generate_refused"):  # pp / cp: refused with the reason, on every rank, before communicating
            try:
                result.model.generate(input_ids=torch.ones(2, 4, dtype=torch.long), max_new_tokens=2)
                saved["generate_error"] = None
            except (NotImplementedError, ValueError) as err:
                saved["generate_error"] = str(err)
        if run.get("mixed_precision", "no") != "no":
            batch = next(iter(accelerator._dataloaders[0]))
            problems = dtype_report(result.model, result.optimizer, batch, accelerator)
            every = [None] * dist.get_world_size() if dist.is_initialized() else [problems]
            if dist.is_initialized():
                dist.all_gather_object(every, problems)
            saved["dtype_problems"] = {r: p for r, p in enumerate(every) if p}
            saved["logits_dtype"] = str(result.evals[0].logits_dtype) if result.evals else None
        every_losses = [result.losses]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every_losses = [None] * dist.get_world_size()
            dist.all_gather_object(every_losses, result.losses)
        saved["rank_spread"] = max((abs(a - b) for ls in every_losses for a, b in zip(ls, result.losses)), default=0.0)
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(saved, f"{out_dir}/{run['name']}.pt")
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
