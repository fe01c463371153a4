"""Axolotl's ``model_kwargs`` (its schema's alias of ``overrides_of_model_kwargs``): extra keyword arguments of
``from_pretrained``, passed as Axolotl passes them (loaders/model.py). Keywords ``from_pretrained`` does not take
itself reach the model's config (e.g. ``use_cache``, ``output_router_logits``).

What the run decides itself is refused with the key that says it: the weights' dtype (fp32 master weights; bf16 /
fp16 are mixed precision), the placement (``device_map``: each rank places its part), quantization
(``load_in_4bit`` / ``load_in_8bit`` / ``bnb_config_kwargs``), the attention (``attn_implementation``), the hub
revision (``revision_of_model``), remote code (``trust_remote_code``) and the config (``base_model_config``,
``model_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

DECIDED = {"dtype": "bf16 / fp16 (the ranks load fp32 master weights)", "torch_dtype": "bf16 / fp16",
           "device_map": "the layout (each rank places its part)", "max_memory": "the layout",
           "low_cpu_mem_usage": "nothing (the ranks load tensor by tensor already)",
           "quantization_config": "load_in_4bit / load_in_8bit with bnb_config_kwargs",
           "load_in_4bit": "load_in_4bit", "load_in_8bit": "load_in_8bit", "attn_implementation": "attn_implementation",
           "revision": "revision_of_model", "trust_remote_code": "trust_remote_code",
           "config": "base_model_config / model_config"}


@dataclass(kw_only=True)
class LoadOptions:
    model_kwargs: dict | None = None
    """Extra keyword arguments of from_pretrained (Axolotl's overrides_of_model_kwargs); ones it does not take set
    the model's config."""


def refusals(d: dict) -> list[str]:
    value = d.get("model_kwargs")
    if value is None:
        return []
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return [f"model_kwargs={value!r}: write a mapping of from_pretrained's keyword arguments"]
    return [f"model_kwargs.{key}: the run sets it; use {DECIDED[key]} instead" for key in value if key in DECIDED]


def load_kwargs(t: LoadOptions) -> dict:
    return dict(t.model_kwargs or {})
