"""Axolotl keys about what the model computes in training and the class its config is read with: ``use_eaft``
(with ``eaft_alpha``, ``eaft_k``), ``use_onebitllms`` (1.58-bit linear layers, nd_parallel/models/bitnet.py),
``cls_model_config``, ``evaluation_strategy`` (Axolotl's old name of ``eval_strategy``), and how a LoRA adapter
starts: ``peft: {loftq_config: {loftq_bits}}`` (LoftQ, nd_parallel/models/loftq.py).

EAFT weights each label token's cross-entropy by the entropy of the model's top-k prediction
(nd_parallel/distributed/eaft.py); the ranks install it as the model's loss function before the layout is applied,
so it holds under every layout. ``cls_model_config`` names a transformers config class read instead of AutoConfig
(Axolotl's ``load_model_config``), e.g. ``Gemma3TextConfig`` to train the text model of a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class ObjectiveOptions:
    use_eaft: bool = False
    """Entropy-aware focal training: each label token's loss weighted by its top-eaft_k entropy ** eaft_alpha."""
    eaft_alpha: float = 1.0
    """EAFT's exponent on the entropy (Axolotl's default 1.0)."""
    eaft_k: int = 20
    """EAFT's number of top logits the entropy is taken over (Axolotl's default 20)."""
    cls_model_config: str | None = None
    """A transformers config class read instead of AutoConfig (e.g. Gemma3TextConfig), Axolotl's meaning."""
    use_onebitllms: bool = False
    """BitNet b1.58 training: every Linear but lm_head with ternary weights and 8-bit activations (straight-through)."""
    peft: dict | None = None
    """Axolotl's peft block: {loftq_config: {loftq_bits: 4 | 8}} starts LoRA with LoftQ (the base replaced by its
    quantized round trip, the adapter by the SVD of the difference)."""
    evaluation_strategy: str | None = None
    """Axolotl's deprecated name of eval_strategy: read as eval_strategy when that is not set (Axolotl's rule)."""


def objective_refusals(d: dict) -> list[str]:
    """Check the keys above in the YAML mapping ``d`` (in place: evaluation_strategy becomes eval_strategy)."""
    out = []
    old = d.pop("evaluation_strategy", None)
    if old is not None and d.get("eval_strategy") is None:
        d["eval_strategy"] = old
    if d.get("use_eaft") is not None and not isinstance(d["use_eaft"], bool):
        out.append(f"use_eaft={d['use_eaft']!r}; use true or false")
    alpha, k = d.get("eaft_alpha"), d.get("eaft_k")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0):
        out.append(f"eaft_alpha={alpha!r}: write a number >= 0 (the exponent on the entropy; Axolotl's default 1.0)")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        out.append(f"eaft_k={k!r}: write an integer >= 1 (top logits the entropy is taken over; Axolotl's default 20)")
    if d.get("use_eaft") is True:
        out += _eaft_combinations(d)
    out += _onebitllms(d) + _peft(d)
    name = d.get("cls_model_config")
    if name is not None and _config_class(name) is None:
        out.append(f"cls_model_config={name!r} is not a transformers config class; write one such as "
                   "Gemma3TextConfig or LlamaConfig, or drop it (AutoConfig reads the checkpoint's own)")
    return out


def objective_notes(d: dict) -> list[str]:
    """The line printed when EAFT is on: its memory cost (the full logits of each micro-batch are held)."""
    if d.get("use_eaft") is not True:
        return []
    return ["use_eaft: each token's loss is weighted by its top-k entropy, computed from the full logits: the "
            "chunked loss (loss_chunk_size) stands aside and each micro-batch's [tokens, vocab] logits are held"]


def _eaft_combinations(d: dict) -> list[str]:
    out = []
    if d.get("rl"):
        out.append(f"use_eaft with rl={d['rl']!r}: EAFT weights the supervised cross-entropy; the preference "
                   "trainers compute their own losses: drop one of them")
    chunk = d.get("loss_chunk_size")
    if chunk not in (None, 0, "auto"):
        out.append(f"use_eaft with loss_chunk_size={chunk!r}: EAFT's weights come from each token's full logits, "
                   "which the chunked loss never holds; drop loss_chunk_size (or set 0)")
    if d.get("liger_fused_linear_cross_entropy"):
        out.append("use_eaft with liger_fused_linear_cross_entropy: the fused kernel never forms the logits EAFT "
                   "weighs; drop one of them")
    return out


def _onebitllms(d: dict) -> list[str]:
    value = d.get("use_onebitllms")
    if value is None or value is False:
        return []
    if value is not True:
        return [f"use_onebitllms={value!r}; use true or false"]
    out = []
    if d.get("adapter"):  # Axolotl's rule (check_onebitllms_lora)
        out.append(f"use_onebitllms with adapter={d['adapter']!r}: 1.58-bit training trains the full weights (Axolotl "
                   "refuses LoRA/QLoRA with it too); drop adapter")
    if d.get("load_in_4bit") or d.get("load_in_8bit") or d.get("qat"):
        out.append("use_onebitllms with load_in_4bit / load_in_8bit / qat: the linear layers are ternary-quantized "
                   "already; drop the other quantization")
    return out


def _peft(d: dict) -> list[str]:
    value = d.get("peft")
    if value in (None, {}):
        d.pop("peft", None)
        return []
    loftq = value.get("loftq_config") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and set(value) <= {"loftq_config"} and isinstance(loftq, dict)
            and set(loftq) <= {"loftq_bits"} and loftq.get("loftq_bits", 4) in (4, 8)):
        return [f"peft={value!r}: Axolotl's peft block holds loftq_config: {{loftq_bits: 4}} (or 8); write that, or "
                "drop it"]
    if d.get("adapter") != "lora" or d.get("load_in_4bit") or d.get("load_in_8bit") or d.get("lora_model_dir"):
        return ["peft.loftq_config: LoftQ starts a new LoRA adapter on an unquantized base (it quantizes the base "
                "itself); set adapter: lora without load_in_4bit / load_in_8bit / lora_model_dir, or drop it"]
    if d.get("lora_target_parameters"):
        return ["peft.loftq_config with lora_target_parameters: LoftQ initializes LoRA on Linear layers only; drop "
                "one of them"]
    import importlib.util

    missing = [p for p in ("bitsandbytes", "scipy") if importlib.util.find_spec(p) is None]
    if missing:  # peft's LoftQ quantizes with bitsandbytes and requires scipy
        return [f"peft.loftq_config needs {' and '.join(missing)}, not installed: pip install 'nd_parallel[loftq]'"]
    return []


def adapter_kwargs(t: ObjectiveOptions) -> dict:
    """LoraConfig arguments for ``peft``: LoftQ's initialization (peft's LoftQConfig; loftq_iter 1, as Axolotl)."""
    loftq = (t.peft or {}).get("loftq_config")
    if loftq is None:
        return {}
    from peft import LoftQConfig

    return {"init_lora_weights": "loftq", "loftq_config": LoftQConfig(loftq_bits=loftq.get("loftq_bits", 4))}


def _config_class(name: Any):
    import transformers

    if not isinstance(name, str) or not name.isidentifier():
        return None
    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig) else None


def config_kwargs(t: ObjectiveOptions, source: str, extra: dict) -> dict:
    """``{"config": ...}`` for from_pretrained when cls_model_config names the class; {} otherwise."""
    if not t.cls_model_config:
        return {}
    trust = {"trust_remote_code": extra["trust_remote_code"]} if "trust_remote_code" in extra else {}
    return {"config": _config_class(t.cls_model_config).from_pretrained(source, **trust)}


def install_loss(t: ObjectiveOptions, model) -> None:
    """BitNet layers and EAFT as the model's loss function (before the adapter and the layout)."""
    if t.use_onebitllms:
        import os

        from nd_parallel.models.bitnet import to_bitnet

        layers = to_bitnet(model)
        if os.environ.get("RANK", "0") == "0":
            print(f"[nd_parallel] use_onebitllms: {len(layers)} linear layers train as 1.58-bit (ternary weights, "
                  "8-bit activations; lm_head unchanged)", flush=True)
    if t.use_eaft:
        from nd_parallel.distributed.eaft import use_eaft_loss

        use_eaft_loss(model, alpha=t.eaft_alpha, k=t.eaft_k)
