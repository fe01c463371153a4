"""The parent side of `nd-parallel train`: YAML -> checked layout, prepared data and the Trainer's arguments, all
before any rank starts, so that every bad input stops the run here with the file, the record and the fix."""

from __future__ import annotations

import math
import os
from dataclasses import asdict

from nd_parallel.config import ConfigError

from .config import TrainConfig, load_train_config
from .rank import mixed_precision


def _steps_per_epoch(cfg: TrainConfig, rows: int, dp: int) -> int:
    """Optimizer steps in one pass over `rows` samples: each dp rank takes ceil(rows / dp) of them."""
    return max(1, math.ceil(math.ceil(math.ceil(rows / dp) / cfg.micro_batch_size) / cfg.gradient_accumulation_steps))


def _every(steps: int | float | None, per_epoch: int | None, epoch_steps: int) -> int | float | None:
    """Axolotl's evals_per_epoch / saves_per_epoch as a step interval (an explicit *_steps wins)."""
    if steps is not None:
        return steps
    return max(1, epoch_steps // per_epoch) if per_epoch else None


def trainer_arguments(cfg: TrainConfig, name: str, train_rows: int, eval_rows: int, dp: int) -> dict:
    """TrainingArguments(**this) on every rank: Axolotl's keys in the Trainer's words."""
    import torch

    epoch_steps = _steps_per_epoch(cfg, train_rows, dp)
    eval_every = _every(cfg.eval_steps, cfg.evals_per_epoch, epoch_steps)
    save_every = _every(cfg.save_steps, cfg.saves_per_epoch, epoch_steps)
    eval_strategy = "no" if not eval_rows else cfg.eval_strategy or ("steps" if eval_every else "epoch")
    save_strategy = cfg.save_strategy or ("steps" if save_every else "no")
    args = dict(
        output_dir=cfg.output_dir, run_name=name, report_to=[], disable_tqdm=True, remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(), seed=cfg.seed,
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size or cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, num_train_epochs=cfg.num_epochs,
        max_steps=cfg.max_steps or -1, optim=cfg.optimizer, learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        # transformers 5 reads a warmup_steps below 1 as a share of the steps (what warmup_ratio was)
        warmup_steps=cfg.warmup_ratio if cfg.warmup_ratio is not None else (cfg.warmup_steps or 0),
        bf16=mixed_precision(cfg.bf16) == "bf16",
        logging_strategy="steps", logging_steps=1,  # one train_log.jsonl line per optimizer step
        eval_strategy=eval_strategy, save_strategy=save_strategy, save_total_limit=cfg.save_total_limit)
    if eval_strategy == "steps":
        args["eval_steps"] = eval_every
    if save_strategy == "steps":
        args["save_steps"] = save_every or 500
    if cfg.tf32 is True and torch.cuda.is_available():  # TF32 exists on CUDA only; on CPU ranks the key is a no-op
        args["tf32"] = True
    for key in ("adam_beta1", "adam_beta2", "adam_epsilon"):
        if getattr(cfg, key) is not None:
            args[key] = getattr(cfg, key)
    return args


def check_layout_rules(cfg: TrainConfig, path) -> None:
    if cfg.parallel.pp_size > 1 and cfg.parallel.pp_backend == "deepspeed" and cfg.gradient_accumulation_steps > 1:
        # DeepSpeed all-reduces a tied weight's whole gradient at the end of every schedule run, so a second
        # accumulated run would count the first one's tied gradient twice.
        raise ConfigError(f"{path}: gradient_accumulation_steps={cfg.gradient_accumulation_steps} with "
                          "pp_backend='deepspeed': the pipeline already splits each step into micro-batches; set "
                          "gradient_accumulation_steps: 1 and raise pp_microbatches, or use pp_backend='torch'")
    resume = cfg.resume_from_checkpoint
    if resume and resume != "auto" and not os.path.isdir(resume):
        raise ConfigError(f"{path}: resume_from_checkpoint={resume!r} is not a directory; point it at a "
                          f"checkpoint-N folder under {cfg.output_dir}, or write 'auto' for the latest complete one")


def build_job(path, cfg: TrainConfig, layout, workdir: str, quiet: bool = True) -> tuple[dict, object]:
    """(the ranks' job, the Prepared data) for a loaded config and a resolved layout."""
    from .data import prepare

    check_layout_rules(cfg, path)
    prepared = prepare(cfg, workdir)
    per_micro = cfg.micro_batch_size * layout.dp_size
    if prepared.train_rows < per_micro:
        raise ConfigError(f"{path}: {prepared.train_rows} training samples, but one micro-batch over "
                          f"{layout.dp_size} data-parallel ranks needs micro_batch_size x {layout.dp_size} = "
                          f"{per_micro}; add data or lower micro_batch_size")
    train = {k: v for k, v in asdict(cfg).items() if k not in ("parallel", "datasets", "unused")}
    name = os.path.splitext(os.path.basename(str(path)))[0]
    job = {"kind": "train", "name": name, "layout": layout.to_dict(), "prepared": prepared.path, "train": train,
           "trainer_args": trainer_arguments(cfg, name, prepared.train_rows, prepared.eval_rows, layout.dp_size),
           "quiet": quiet}
    return job, prepared


__all__ = ["build_job", "load_train_config", "trainer_arguments"]
