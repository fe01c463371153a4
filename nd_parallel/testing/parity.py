"""One training recipe run two ways: a single process on the global batch, and under a layout.

The parity tests, the demo and the benchmarks share it, so "equals single-process training" means the
same thing everywhere: same checkpoint, same global batches, AdamW, a linearly decaying LR, clipping at 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader


@dataclass
class Recipe:
    steps: int = 5
    lr: float = 1e-3
    max_norm: float = 1.0
    per_rank_batch: int = 2
    # AdamW's first update is lr * g / (|g| + eps): for an element whose gradient happens to be ~eps its
    # sensitivity to g is lr / (4 eps), 2.5e4 at eps=1e-8. fp32 reduction-order noise of ~1e-9 in such a
    # gradient (measured: an o_proj element with g = 1.4e-8 under PP2xTP2) then moves that one weight by
    # ~2e-5 while every loss and grad norm agrees to 1e-7. eps=1e-6 bounds the amplification at 250, so the
    # 1e-5 parameter tolerance tests the parallel math rather than the conditioning of Adam's division.
    adam_eps: float = 1e-6
    eval_at: tuple[int, ...] = ()  # evaluate on the eval samples before these (0-based) optimizer steps
    optim: str = "adamw_torch"  # or "adamw_8bit": bitsandbytes' AdamW8bit, same hyper-parameters (8-bit state)


@dataclass
class EvalResult:
    step: int
    losses: list[float]  # the global-token-mean loss of each eval batch, as model(**batch) returned it
    logits: torch.Tensor | None  # every eval sample's logits (gathered over dp), in dataset order, as fp32
    logits_dtype: torch.dtype | None = None  # the dtype the model computed them in


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None  # train_layout's prepared optimizer: what this rank holds
    evals: list[EvalResult] = field(default_factory=list)
    model: torch.nn.Module | None = None  # train_layout's prepared model
    # fp16 (a loss scaler): the scale after each step's update, and whether the step was skipped (overflow)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)


def optimizer_and_schedule(model, recipe: Recipe):
    """AdamW over every parameter (frozen ones get no state) and a linearly decaying LR."""
    if recipe.optim == "adamw_8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(model.parameters(), lr=recipe.lr, weight_decay=0.01, eps=recipe.adam_eps)
    elif recipe.optim == "adamw_torch":
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, eps=recipe.adam_eps)
    else:
        raise ValueError(f"Recipe.optim={recipe.optim!r}: use 'adamw_torch' or 'adamw_8bit'")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * recipe.steps))
    return opt, sched


def _collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def train_reference(model_dir, samples, dp_size: int, recipe: Recipe, model=None, progress=None,
                    scaler=None, before_step=None) -> RunResult:
    """Single process, global batch = per_rank_batch * dp_size consecutive samples (what dp ranks share).

    ``model``: an already built model (e.g. wrapped with PEFT) instead of ``from_pretrained(model_dir)``.
    ``progress(step, loss)``: called after each optimizer step, as train_layout calls it.
    ``before_step(step, model, optimizer)``: called before each step's forward (a Trainer's on_step_begin), with
    the model and optimizer that train (train_layout passes the prepared ones).
    ``scaler``: a ``torch.amp.GradScaler`` (fp16), used as torch documents it; the LR schedule skips a skipped
    step, as Accelerate's does.
    """
    from transformers import AutoModelForCausalLM

    model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir)
    opt, sched = optimizer_and_schedule(model, recipe)
    loader = DataLoader(samples, batch_size=recipe.per_rank_batch * dp_size, collate_fn=_collate)
    result = RunResult()
    for step, batch in enumerate(loader):
        if step == recipe.steps:
            break
        if before_step is not None:
            before_step(step, model, opt)
        loss = model(**batch).loss
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        result.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_norm).item())
        result.losses.append(loss.item())
        if scaler is None:
            opt.step()
            sched.step()
        else:
            skipped = bool(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))
            scaler.step(opt)
            scaler.update()
            if not skipped:
                sched.step()
            result.scales.append(scaler.get_scale())
            result.skipped.append(skipped)
        opt.zero_grad()
        if progress is not None:
            progress(step, result.losses[-1])
    result.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result.optimizer = opt
    return result


def evaluate(accelerator, model, loader, step: int) -> EvalResult:
    """``model.eval()`` + ``no_grad`` over ``loader``: the loss of each batch and every sample's logits."""
    model.eval()
    losses, logits, dtype = [], [], None
    with torch.no_grad():
        for batch in loader:
            out = model(**batch)
            losses.append(out.loss.item())
            dtype = out.logits.dtype
            logits.append(accelerator.gather_for_metrics(out.logits.float()))
    model.train()
    return EvalResult(step, losses, torch.cat(logits).cpu(), dtype)


def train_layout(accelerator, plugin, model_dir, samples, recipe: Recipe, progress=None, eval_samples=None,
                 model=None, before_step=None) -> RunResult:
    """The unchanged Accelerate loop of docs/architecture.md, under whatever layout ``plugin`` holds."""
    model = model if model is not None else plugin.from_pretrained(model_dir)
    opt, sched = optimizer_and_schedule(model, recipe)
    loader = DataLoader(samples, batch_size=recipe.per_rank_batch, collate_fn=_collate)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    eval_loader = None
    if eval_samples is not None:
        eval_loader = accelerator.prepare(DataLoader(eval_samples, batch_size=recipe.per_rank_batch,
                                                     collate_fn=_collate))
    result = RunResult()
    for step, batch in enumerate(loader):
        if step in recipe.eval_at and eval_loader is not None:
            result.evals.append(evaluate(accelerator, model, eval_loader, step))
        if step == recipe.steps:
            break
        if before_step is not None:
            before_step(step, model, opt)
        out = model(**batch)
        accelerator.backward(out.loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), recipe.max_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        result.losses.append(out.loss.item())
        result.norms.append(float(norm))
        if accelerator.scaler is not None:
            result.scales.append(accelerator.scaler.get_scale())
            result.skipped.append(opt.step_was_skipped)
        if progress is not None:
            progress(step, out.loss.item())
    result.state = accelerator.get_state_dict(model)
    result.optimizer = opt
    result.model = model
    return result


def compare(ref: RunResult, run: RunResult) -> dict[str, float]:
    """Max relative loss / grad-norm difference per step, max absolute parameter difference at the end."""
    if len(ref.losses) != len(run.losses):
        raise AssertionError(f"ran {len(run.losses)} steps, reference ran {len(ref.losses)}")
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    missing = set(ref.state) ^ set(run.state)
    if missing:
        raise AssertionError(f"state dict keys differ from the reference: {sorted(missing)}")
    return {
        "loss_rel": max(rel(a, b) for a, b in zip(run.losses, ref.losses)),
        "norm_rel": max(rel(a, b) for a, b in zip(run.norms, ref.norms)),
        "param_abs": max((run.state[k].float() - ref.state[k].float()).abs().max().item() for k in ref.state),
    }
