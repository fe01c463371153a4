"""The LoRA parity recipe shared by the rank program (peft_worker.py) and the single-process reference.

A LoRA adapter on every attention and MLP projection (column-wise and row-wise bases under TP), no dropout (so
ranks draw no random numbers), trained with AdamW on the adapter only. Two ways to get the model, both with the
adapter init fixed by the torch seed:
- "wrap": the user's path, ``get_peft_model`` on a loaded model before ``prepare``;
- "load": ``plugin.from_pretrained(path, peft_config=...)``, memory-efficient (each rank reads its slices).

The reference of both is plain PEFT on plain transformers in one process (``get_peft_model`` on
``AutoModelForCausalLM.from_pretrained``), nothing of nd_parallel. The memory-efficient path draws its adapter
init differently (``build_meta_peft_model``), so for "load" the rank program records the values it initialised
(``initial_adapter``) and the reference starts from those.
"""

from __future__ import annotations

import torch

from nd_parallel.testing import parity
from nd_parallel.testing.parity import Recipe, RunResult, optimizer_and_schedule  # noqa: F401 (re-exported)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 1234


def lora_config(**overrides):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": TARGETS,
                         "task_type": "CAUSAL_LM", **overrides})


def reference_model(model_dir, how: str, adapter_init: dict | None = None):
    """One process, no plugin: the model the layouts must match. ``adapter_init`` ("load"): the memory-efficient
    path's initial LoRA factors (``initial_adapter`` below), copied over PEFT's own init."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(SEED)
    model = get_peft_model(model, lora_config())
    if how == "wrap":
        return model
    factors = {name: p for name, p in model.get_base_model().named_parameters() if ".lora_" in name}
    if adapter_init is None or set(adapter_init) != set(factors):
        raise ValueError(f"the 'load' reference needs the initial value of every LoRA factor: got "
                         f"{sorted(set(adapter_init or ()) ^ set(factors))[:4]} extra or missing")
    with torch.no_grad():
        for name, p in factors.items():
            p.copy_(adapter_init[name])
    return model


def initial_adapter(model) -> dict[str, torch.Tensor]:
    """The LoRA factors ``plugin.from_pretrained(path, peft_config=...)`` initialised (it holds them off the meta
    device until prepare copies each rank's piece), under the names of the model inside the PeftModel."""
    from nd_parallel.models.meta import lazy_checkpoint

    return {name: t.clone() for name, t in lazy_checkpoint(model.get_base_model()).initial.items()}


def layout_model(plugin, model_dir, how: str):
    from peft import get_peft_model

    torch.manual_seed(SEED)
    if how == "wrap":
        model = plugin.from_pretrained(model_dir, memory_efficient=False)
        torch.manual_seed(SEED)
        return get_peft_model(model, lora_config())
    return plugin.from_pretrained(model_dir, peft_config=lora_config())


def train_reference(model_dir, how, samples, dp_size: int, recipe: Recipe, adapter_init=None) -> RunResult:
    """The one-process run; ``result.model`` is the trained PeftModel (its in-memory adapter)."""
    model = reference_model(model_dir, how, adapter_init)
    model.train()  # LoRA dropout, if any, as in the layouts' training
    result = parity.train_reference(model_dir, samples, dp_size, recipe, model=model)
    result.model = model
    return result
