"""`nd-parallel train`'s progress bar and log, as a TrainerCallback (main process only).

The Trainer logs every optimizer step (logging_steps=1 in TrainingArguments, so that ``train_log.jsonl`` has one
JSON object per step: step, loss, grad_norm, lr, epoch); the YAML's logging_steps only sets how often a line is
printed under the bar. Evaluation results go to ``eval_log.jsonl`` (step, eval_loss).
"""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback

from . import lm_eval

LOG_FILE = "train_log.jsonl"
EVAL_LOG_FILE = "eval_log.jsonl"
GENERATION_METRICS = tuple(f"eval_{name}" for name in lm_eval.METRICS)  # do_causal_lm_eval's (lm_eval.py)


RL_METRICS = ("reward", "rewards/", "completions/", "kl", "ebft/")  # what GRPOTrainer logs of its completions


class ProgressAndLog(TrainerCallback):
    def __init__(self, output_dir: str, print_every: int, desc: str, append: bool = False):
        self.output_dir, self.print_every, self.desc, self.append = output_dir, print_every, desc, append
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from tqdm.auto import tqdm

        os.makedirs(self.output_dir, exist_ok=True)
        mode = "a" if self.append else "w"  # a resumed run continues the log of the run it resumes
        for name in (LOG_FILE, EVAL_LOG_FILE):
            open(os.path.join(self.output_dir, name), mode, encoding="utf-8").close()
        self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.desc, dynamic_ncols=True)

    def _write(self, name: str, record: dict) -> None:
        with open(os.path.join(self.output_dir, name), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is None or not logs:
            return
        step = state.global_step
        if "loss" in logs:
            record = {"step": step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm"),
                      "lr": logs.get("learning_rate"), "epoch": logs.get("epoch"),
                      **{k: v for k, v in logs.items() if k.startswith(RL_METRICS)}}  # rl: grpo's rewards
            self._write(LOG_FILE, record)
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}")
            if step % self.print_every == 0:
                self.bar.write(f"step {step}/{state.max_steps}  loss {logs['loss']:.4f}  grad_norm "
                               f"{logs.get('grad_norm', float('nan')):.4f}  lr {logs.get('learning_rate', 0):.3g}")
        if "eval_loss" in logs:
            self._write(EVAL_LOG_FILE, {"step": step, "eval_loss": logs["eval_loss"], **{
                k: v for k, v in logs.items() if k.startswith(tuple(f"eval_{m}" for m in RL_METRICS))}})
            self.bar.write(f"step {step}/{state.max_steps}  eval_loss {logs['eval_loss']:.4f}")
        generated = {k: v for k, v in logs.items() if k in GENERATION_METRICS}  # do_causal_lm_eval (lm_eval.py)
        if generated:
            self._write(EVAL_LOG_FILE, {"step": step, **generated})
            self.bar.write(f"step {step}/{state.max_steps}  " + "  ".join(f"{k} {v:.4f}" for k, v in generated.items()))

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StopBeforeTheFirstStep(TrainerCallback):
    """For a run resumed at its last step: the Trainer would take one step more than max_steps (it checks for the
    end only after a step), so stop it once the model is prepared and loaded, before that step runs. Every rank
    raises at the same point."""

    class Reached(Exception):
        pass

    def on_step_begin(self, args, state, control, **kwargs):
        raise self.Reached


# ------------------------------------------------------------------------------------ trainer_callbacks: key
def callback_specs(path, value) -> list[dict]:
    """The YAML's ``trainer_callbacks``, checked in the parent before any rank starts: each entry is ``module:Class``
    or ``{class: module:Class, args: {...}}``, and the class must import and be a ``TrainerCallback``."""
    from nd_parallel.config import ConfigError

    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{path}: trainer_callbacks={value!r}; write a list, e.g. [mypkg.callbacks:MyCallback]")
    specs = []
    for entry in value:
        spec = {"class": entry, "args": {}} if isinstance(entry, str) else entry
        if not (isinstance(spec, dict) and isinstance(spec.get("class"), str) and set(spec) <= {"class", "args"}
                and isinstance(spec.get("args", {}), dict)):
            raise ConfigError(f"{path}: trainer_callbacks entry {entry!r}; write 'module:Class' or "
                              "{class: 'module:Class', args: {name: value}}")
        _import_callback(path, spec["class"])
        specs.append({"class": spec["class"], "args": dict(spec.get("args", {}))})
    return specs


def _import_callback(path, name: str):
    import importlib

    from nd_parallel.config import ConfigError

    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr) if attr else None
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{path}: trainer_callbacks: cannot import {name!r} ({err}); write 'module:Class' with "
                          "the module importable on every node") from None
    if not (isinstance(cls, type) and issubclass(cls, TrainerCallback)):
        raise ConfigError(f"{path}: trainer_callbacks: {name!r} is not a transformers.TrainerCallback class")
    return cls


def user_callbacks(specs: list[dict] | None) -> list[TrainerCallback]:
    """On every rank: the YAML's trainer_callbacks, built with their args."""
    return [_import_callback("trainer_callbacks", s["class"])(**s["args"]) for s in specs or []]


class LossWatchdog(TrainerCallback):
    """Axolotl's loss_watchdog_threshold / loss_watchdog_patience: when the logged loss stays above the threshold
    for `patience` steps in a row, print why and stop training (the Trainer then saves as at a normal end)."""

    def __init__(self, threshold: float, patience: int | None):
        self.threshold, self.patience, self.violations = threshold, patience or 3, 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.log_history and "loss" in state.log_history[-1]:
            loss = state.log_history[-1]["loss"]
            if loss <= self.threshold:
                self.violations = 0
                return control
            self.violations += 1
            if self.violations >= self.patience:
                if state.is_world_process_zero:
                    print(f"[nd_parallel] loss {loss:.4f} > loss_watchdog_threshold={self.threshold} for "
                          f"{self.violations} steps: stopping training", flush=True)
                control.should_training_stop = True
        return control


def watchdog(t) -> list:
    """[LossWatchdog] when the YAML sets loss_watchdog_threshold, [TriggerSave] with dynamic_checkpoint,
    [EarlyStoppingCallback] with
    early_stopping_patience (as Axolotl adds it; the Trainer reloads the best checkpoint at the end)."""
    from transformers import EarlyStoppingCallback

    from .trigger_save import callbacks as trigger_save

    out = [LossWatchdog(t.loss_watchdog_threshold, t.loss_watchdog_patience)] if t.loss_watchdog_threshold else []
    out += trigger_save(t)  # dynamic_checkpoint: a checkpoint when output_dir/<file> appears
    return out + ([EarlyStoppingCallback(t.early_stopping_patience)] if t.early_stopping_patience else [])


class FakeQuantAfter(TrainerCallback):
    """qat's fake_quant_after_n_steps: the fake quantizers off for the first `n` optimizer steps, on from then.
    Set before every step from the step count (Axolotl switches only at steps 0 and n), so a run resumed on either
    side of n is in the right state."""

    def __init__(self, n: int):
        self.n, self.on = n, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        from nd_parallel.models.qat import set_fake_quant

        on = state.global_step >= self.n
        layers = set_fake_quant(model, on)
        if on != self.on and on and getattr(state, "is_world_process_zero", False):
            print(f"[nd_parallel] qat: fake quantization on from step {state.global_step} ({layers} layers)", flush=True)
        self.on = on


def fake_quant_after(t) -> list:
    n = (t.qat or {}).get("fake_quant_after_n_steps")
    return [FakeQuantAfter(n)] if n else []
