"""tiny_config builds, at TINY's sizes and 2 layers, the families whose defaults do not (the overrides the Axolotl
example runs needed, issue 19): each model runs forward and backward, and keeps the structure its checkpoints have."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nd_parallel.testing.models import tiny_config

FOLDED = ["gptj", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v2", "glm4_moe_lite", "lfm2_moe", "gemma3n_text",
          "dbrx"]


@pytest.mark.parametrize("family", FOLDED)
def test_tiny_config_builds_and_trains(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    loss = model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), labels=torch.tensor([[1, 2, 3, 4, 5]])).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_input_embeddings().weight.grad is not None
    assert sum(p.numel() for p in model.parameters()) < 4_000_000, family  # tiny: the experts shrunk too
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    if family.startswith("qwen3_5"):  # both kinds of a hybrid, so LoRA on q_proj finds one
        assert layer_types == ["linear_attention", "full_attention"]
