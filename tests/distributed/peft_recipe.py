"""The LoRA parity recipe shared by the rank program (peft_worker.py) and the single-process reference.

A LoRA adapter on every attention and MLP projection (column-wise and row-wise bases under TP), no dropout (so
ranks draw no random numbers), trained with AdamW on the adapter only. Two ways to get the model, both with the
adapter init fixed by the torch seed:
- "wrap": the user's path, ``get_peft_model`` on a loaded model before ``prepare``;
- "load": ``plugin.from_pretrained(path, peft_config=...)``, memory-efficient (each rank reads its slices).
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


def reference_model(model_dir, how: str):
    """One process, no plugin: the model the layouts must match."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from nd_parallel.models.loading import lazy_checkpoint, load_local_shards
    from nd_parallel.models.meta import build_meta_peft_model

    torch.manual_seed(SEED)
    if how == "wrap":
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        torch.manual_seed(SEED)
        return get_peft_model(model, lora_config())
    model = build_meta_peft_model(model_dir, lora_config())
    inner = model.get_base_model()
    load_local_shards([inner], lazy_checkpoint(inner), torch.device("cpu"))
    return model


def layout_model(plugin, model_dir, how: str):
    from peft import get_peft_model

    torch.manual_seed(SEED)
    if how == "wrap":
        model = plugin.from_pretrained(model_dir, memory_efficient=False)
        torch.manual_seed(SEED)
        return get_peft_model(model, lora_config())
    return plugin.from_pretrained(model_dir, peft_config=lora_config())


def train_reference(model_dir, how, samples, dp_size: int, recipe: Recipe) -> RunResult:
    model = reference_model(model_dir, how)
    model.train()  # LoRA dropout, if any, as in the layouts' training
    return parity.train_reference(model_dir, samples, dp_size, recipe, model=model)
