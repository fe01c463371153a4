"""LISA and ReLoRA parity recipes shared by the rank program (restarts_worker.py) and the one-process reference
(test_restarts.py): the parity loop with the callbacks' switch (LISA) or restart (ReLoRA) run before each step, on
the model and optimizer that train (``before_step``), as the Trainer's on_step_begin runs them."""

from __future__ import annotations

import torch
from peft_recipe import SEED, lora_config

from nd_parallel.plugins.trainer.lisa import draw_layers, set_active_layers, switches_at
from nd_parallel.plugins.trainer.relora import merge_and_reinit, prune_moments, prune_ratio
from nd_parallel.testing.parity import train_reference

LAYERS = 4  # the tiny model's decoder layers
# a new layer before every step, 6 steps: layers [3], [0], [0], [0], [1], [3] (seed 1234): layer 3 trains, waits
# frozen for 4 steps with its AdamW moments kept, and trains again; layer 2 is never drawn
LISA = {"n": 1, "every": 1, "steps": 6}
RELORA_EVERY = 2  # restarts before steps 2 and 4


def lisa_hook(n: int, every: int, seed: int = SEED, steps: int | None = None):
    def before_step(step, model, optimizer):
        if switches_at(step, every):
            set_active_layers(model, "model.layers", draw_layers(seed, step, LAYERS, n))
    return before_step


def relora_hook(method: str, ratio: float | None = None, every: int = RELORA_EVERY, seed: int = SEED,
                moments: dict | None = None, steps: int | None = None):
    """ReLoRA's restart before steps every, 2 every, ...; ``moments``: filled with the adapter's Adam moments
    right after the first restart (whole, by canonical name), the selection the pruning made."""
    def before_step(step, model, optimizer):
        if step and step % every == 0:
            merge_and_reinit(model, seed, step, cpu_offload=method == "random")
            prune_moments(model, optimizer, seed, step, method, prune_ratio(method, ratio))
            if moments is not None and not moments:
                moments.update(adapter_moments(model, optimizer))
    return before_step


def adapter_moments(model, optimizer) -> dict:
    from nd_parallel.plugins.trainer.relora import _inner_optimizer, _whole, canonical

    state = _inner_optimizer(optimizer).state
    return {f"{canonical(n)}:{k}": _whole(state[p][k]).detach().clone() for n, p in model.named_parameters()
            if "lora_" in n and state.get(p) for k in ("exp_avg", "exp_avg_sq")}


def lora_model(model_dir, plugin=None):
    """The tiny model with the LoRA recipe's adapter, the same init in one process and under a layout."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = (plugin.from_pretrained(model_dir, memory_efficient=False) if plugin is not None
             else AutoModelForCausalLM.from_pretrained(model_dir))
    torch.manual_seed(SEED)
    return get_peft_model(model, lora_config())


def reference(kind: str, model_dir, samples, dp: int, recipe, option):
    """One process on the global batch: LISA on the full model, or ReLoRA on the LoRA model (``result.moments``:
    the adapter's moments right after the first restart)."""
    if kind == "lisa":
        return train_reference(model_dir, samples, dp, recipe, before_step=lisa_hook(**option))
    moments = {}
    result = train_reference(model_dir, samples, dp, recipe, model=lora_model(model_dir),
                             before_step=relora_hook(**option, moments=moments))
    result.moments = moments
    return result
