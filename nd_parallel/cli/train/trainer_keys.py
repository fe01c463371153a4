"""Axolotl keys that set what the Trainer does around the steps: the best checkpoint's model at the end
(``load_best_model_at_end``, ``early_stopping_patience``) and the cosine schedule's constant tail
(``cosine_constant_lr_ratio``, built by schedules.use_constant_tail).

Axolotl 0.19 turns ``load_best_model_at_end`` on only when an evaluation split exists and ``save_steps`` and
``eval_steps`` are set with ``eval_steps`` dividing ``save_steps``, and silently leaves it off otherwise
(builders/causal.py); it ignores ``cosine_constant_lr_ratio`` without a non-zero ``cosine_min_lr_ratio`` on the
cosine schedule (trainers/mixins/scheduler.py). Each of those silent cases is
refused here with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TrainerKeyOptions:
    early_stopping_patience: int | None = None
    """Stop after this many evaluations without a lower eval loss, then reload the best checkpoint's model
    (transformers' EarlyStoppingCallback and load_best_model_at_end, as Axolotl adds them)."""
    load_best_model_at_end: bool = False
    """At the end, reload the checkpoint with the lowest eval loss (metric_for_best_model) and save that model
    (transformers' load_best_model_at_end); needs val_set_size (or test_datasets), save_steps and eval_steps
    dividing save_steps."""
    cosine_constant_lr_ratio: float | None = None
    """lr_scheduler: cosine reaches learning_rate x cosine_min_lr_ratio at this share of the steps and stays there
    (Axolotl's get_cosine_schedule_with_warmup_decay_constant)."""


def loads_best(t) -> bool:
    return bool(t.early_stopping_patience or t.load_best_model_at_end)


def refusals(d: dict) -> list[str]:
    return _best_model(d) + _constant_tail(d) + _schedule_kwargs(d)


def _schedule_kwargs(d: dict) -> list[str]:
    """transformers' schedules that stop the ranks without their arguments (lr_scheduler_kwargs)."""
    kind, kwargs = d.get("lr_scheduler"), d.get("lr_scheduler_kwargs") or {}
    if kind in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") and not ({"min_lr", "min_lr_rate"} & set(kwargs)):
        return [f"lr_scheduler={kind!r} without lr_scheduler_kwargs min_lr or min_lr_rate (transformers needs one); "
                "add it, or write lr_scheduler: cosine with cosine_min_lr_ratio"]
    if kind == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        return ["lr_scheduler='warmup_stable_decay' without lr_scheduler_kwargs num_decay_steps (transformers needs "
                "it); add it"]
    return []


def _best_model(d: dict) -> list[str]:
    """Axolotl's rules for the best-checkpoint reload (save_steps and eval_steps set, eval_steps dividing save_steps,
    an evaluation split), plus what its Trainer would fail on later: the best checkpoint's model read back from
    sharded state, which save_only_model checkpoints lack."""
    patience, best = d.get("early_stopping_patience"), d.get("load_best_model_at_end")
    if best is not None and not isinstance(best, bool):
        return [f"load_best_model_at_end={best!r}; use true or false"]
    if patience is None and not best:
        return []
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
        return [f"early_stopping_patience={patience!r} must be an integer >= 1 (evaluations without improvement)"]
    key = "early_stopping_patience" if patience is not None else "load_best_model_at_end"
    out, save, every = [], d.get("save_steps"), d.get("eval_steps")
    if not save or not every:
        out.append(f"{key} with save_steps={save!r}, eval_steps={every!r}: set both (Axolotl's rule: the best "
                   "checkpoint must be saved at an evaluation), with eval_steps dividing save_steps")
    elif isinstance(save, (int, float)) and isinstance(every, (int, float)) and save % every != 0:
        out.append(f"{key} with save_steps={save} not a multiple of eval_steps={every}: make eval_steps divide "
                   "save_steps (Axolotl's rule: every checkpoint has an evaluation)")
    if not d.get("val_set_size") and not d.get("test_datasets"):
        out.append(f"{key} without val_set_size: the best checkpoint is the one with the lowest evaluation loss; "
                   "set val_set_size (e.g. 0.05) or test_datasets")
    if d.get("save_only_model") is True:
        out.append(f"{key} with save_only_model: the best checkpoint's model is read back from its sharded state, "
                   "which model-only checkpoints do not have (the Trainer refuses this under FSDP too); drop "
                   "save_only_model")
    return out


def _constant_tail(d: dict) -> list[str]:
    ratio = d.get("cosine_constant_lr_ratio")
    if ratio is None or ratio is False or ratio == 0:  # Axolotl reads a falsy ratio as unset
        return []
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        return [f"cosine_constant_lr_ratio={ratio!r}: write a number between 0 and 1 (the share of the steps after "
                "which the learning rate stays at the cosine floor)"]
    floor = d.get("cosine_min_lr_ratio")
    if d.get("lr_scheduler", "cosine") != "cosine" or not floor:  # with lr_quadratic_warmup: extras.py refuses
        return [f"cosine_constant_lr_ratio with lr_scheduler={d.get('lr_scheduler', 'cosine')!r}, "
                f"cosine_min_lr_ratio={floor!r}: the constant tail belongs to the cosine schedule with a floor "
                "(Axolotl ignores it otherwise); set lr_scheduler: cosine with cosine_min_lr_ratio > 0, or drop it"]
    return []
