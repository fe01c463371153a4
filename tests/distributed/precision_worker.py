"""Rank program for the bf16 / activation-checkpointing / evaluation rows: run each spec'd run, save rank 0's view.

Usage (under torchrun, any world size including 1 for the references): precision_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"models": {key: dir}, "runs": [{"name", "model", "layout", "mixed_precision", "samples",
            "recipe", "eval_samples" (optional), "generate" (optional: new tokens), "plain" (optional),
            "held_after_forward" (optional: every rank's bytes held after one training forward),
            "scaler" (optional: fp16's GradScalerKwargs)}]}

Every rank checks the dtypes the bf16 recipe promises (fp32 parameters, gradients and AdamW moments; bf16
compute) and the results record any rank where they did not hold, and every rank's compute dtypes as observed:
the inputs and weights reaching the decoder layers' matmuls (bf16_reference.ComputeDtypes) and the logits.
A run with "plain": true is a one-process reference without nd_parallel (bf16_reference.train_plain).
"""

import gc
import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import GradScalerKwargs, gather_object
from bf16_reference import ComputeDtypes, train_plain
from torch.utils.data import DataLoader

from nd_parallel import NDParallelPlugin, ParallelismConfig
from nd_parallel.distributed.activation_checkpoint import CheckpointedForward
from nd_parallel.planner.measure import LiveTensorBytes
from nd_parallel.testing.models import make_samples
from nd_parallel.testing.parity import Recipe, RunResult, _collate, train_layout


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def dtype_report(model, optimizer, batch, accelerator) -> tuple[list[str], list[str], str]:
    """Problems with the dtypes of master weights, gradients and optimizer state on this rank ([] = none), the
    dtypes this rank's decoder-layer matmuls saw in a training forward, and the dtype of the logits."""
    problems = []
    with ComputeDtypes(model) as probe:
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
    model.eval()  # the logits of a training forward under PP stay on the last stage; evaluation returns them
    with torch.no_grad():
        logits_dtype = str(model(**batch).logits.dtype)
    model.train()
    return problems, sorted(probe.seen), logits_dtype


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


def _every_rank(value) -> list:
    """``value`` from every rank, in rank order (one process: ``[value]``)."""
    return gather_object([value])


def held_after_forward(model, batch, accelerator) -> int:
    """Bytes of tensor storage a training forward creates and still holds when it returns: what autograd and
    checkpointing keep for backward (activations, checkpointed layer inputs), plus what the forward leaves
    allocated the same way in every mode (the root's unsharded parameters under FSDP, the loss). The backward
    then runs as usual, so the run's state is untouched apart from its gradients, which are zeroed."""
    with LiveTensorBytes([]) as live:
        out = model(**batch)
        # garbage in reference cycles is freed only when the collector runs, which depends on each rank's own
        # allocation count: collect it, so that what is left is what the forward keeps for backward
        gc.collect()
        held = live.current
    accelerator.backward(out.loss)
    model.zero_grad(set_to_none=True)
    return held


def _layout_run(run: dict, spec: dict) -> tuple[dict, RunResult]:
    """One run under nd_parallel: (what to save, the run's result)."""
    # Accelerate keeps one AcceleratorState per process; runs with another precision need it reset (the
    # process group, PartialState, stays).
    AcceleratorState._reset_state(reset_partial_state=False)
    handlers = [GradScalerKwargs(**run["scaler"])] if run.get("scaler") else []
    accelerator = Accelerator(mixed_precision=run.get("mixed_precision", "no"), kwargs_handlers=handlers)
    plugin = NDParallelPlugin(ParallelismConfig(**run["layout"])).attach(accelerator)
    samples = make_samples(**run["samples"])
    evals = make_samples(**run["eval_samples"]) if run.get("eval_samples") else None
    model = None
    if run.get("load_dtype"):  # pure low-precision training: the weights themselves in that dtype
        model = plugin.from_pretrained(spec["models"][run["model"]], dtype=getattr(torch, run["load_dtype"]))
    if run.get("hf_gradient_checkpointing"):  # the switch users already know, honoured by prepare
        model = plugin.from_pretrained(spec["models"][run["model"]], memory_efficient=False)
        model.gradient_checkpointing_enable()
    result = train_layout(accelerator, plugin, spec["models"][run["model"]], samples, recipe=Recipe(**run["recipe"]),
                          eval_samples=evals, model=model)
    # How many decoder layers this rank runs under activation checkpointing: a no-op would also be bit-equal.
    checkpointed = sum(isinstance(m.__dict__.get("forward"), CheckpointedForward) for m in result.model.modules())
    saved = {"losses": result.losses, "norms": result.norms, "state": result.state, "checkpointed": checkpointed,
             "scales": result.scales, "skipped": result.skipped,
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
    if run.get("held_after_forward"):  # a PP forward runs the whole schedule, backward included: not asked there
        saved["held"] = _every_rank(held_after_forward(result.model, next(iter(accelerator._dataloaders[0])),
                                                       accelerator))
    if run.get("mixed_precision", "no") != "no":
        batch = next(iter(accelerator._dataloaders[0]))
        every = _every_rank(dtype_report(result.model, result.optimizer, batch, accelerator))
        saved["dtype_problems"] = {r: p for r, (p, _, _) in enumerate(every) if p}
        saved["compute_dtypes"] = [seen for _, seen, _ in every]
        saved["logits_dtype"] = [logits for _, _, logits in every]
    return saved, result


def _plain_run(run: dict, spec: dict) -> dict:
    """One process without nd_parallel (bf16_reference.train_plain), with the same records as a layout's run."""
    evals = make_samples(**run["eval_samples"]) if run.get("eval_samples") else None
    result, seen = train_plain(spec["models"][run["model"]], make_samples(**run["samples"]),
                               Recipe(**run["recipe"]), run["mixed_precision"], eval_samples=evals,
                               scaler_kwargs=run.get("scaler"))
    return {"losses": result.losses, "norms": result.norms, "state": result.state, "compute_dtypes": [sorted(seen)],
            "scales": result.scales, "skipped": result.skipped,
            "evals": [(e.step, e.losses, e.logits) for e in result.evals],
            "logits_dtype": [str(e.logits_dtype) for e in result.evals], "rank_spread": 0.0}


def main(out_dir: str, spec_path: str) -> None:
    spec = json.load(open(spec_path))
    for run in spec["runs"]:
        if run.get("plain"):
            saved = _plain_run(run, spec)
        else:
            saved, result = _layout_run(run, spec)
            saved["rank_spread"] = max((abs(a - b) for ls in _every_rank(result.losses)
                                        for a, b in zip(ls, result.losses)), default=0.0)
            saved["scales_every_rank"] = _every_rank((result.scales, result.skipped))  # fp16: one decision
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(saved, f"{out_dir}/{run['name']}.pt")
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
