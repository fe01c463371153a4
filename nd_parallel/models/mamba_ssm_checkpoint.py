"""``model_type: MambaLMHeadModel`` (Axolotl's examples/mamba): a checkpoint in mamba_ssm's own format
(``config.json`` with ``d_model`` / ``n_layer`` / ``ssm_cfg``, weights in ``pytorch_model.bin``), trained as
transformers' ``MambaForCausalLM``, which is the same network: mamba_ssm's class needs its CUDA kernels, transformers'
port runs a plain-torch path on any device (and mamba_ssm's kernels on CUDA when they are installed).

``convert(source, out)`` writes a transformers checkpoint of the same weights: the config mapped key by key
(``d_model`` -> ``hidden_size``, ``n_layer`` -> ``num_hidden_layers``, ``ssm_cfg``'s ``d_state`` / ``d_conv`` /
``expand`` / ``dt_rank`` / ``conv_bias`` / ``bias`` / ``dt_*`` -> ``state_size`` / ``conv_kernel`` / ``expand`` /
``time_step_rank`` / ``use_conv_bias`` / ``use_bias`` / ``time_step_*``, the vocabulary padded to
``pad_vocab_size_multiple`` as mamba_ssm pads its embedding) and one weight renamed
(``backbone.embedding.weight`` -> ``backbone.embeddings.weight``; the rest have the same names). Written by hand:
transformers' own converter imports mamba_ssm, which does not install without CUDA.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SSM_KEYS = {"d_state": "state_size", "d_conv": "conv_kernel", "expand": "expand", "dt_rank": "time_step_rank",
            "conv_bias": "use_conv_bias", "bias": "use_bias", "dt_min": "time_step_min", "dt_max": "time_step_max",
            "dt_init": "time_step_init_scheme", "dt_scale": "time_step_scale", "dt_init_floor": "time_step_floor"}
# mamba_ssm's MambaConfig keys with no transformers counterpart that change nothing it computes
IGNORED = ("fused_add_norm", "residual_in_fp32", "pad_vocab_size_multiple", "tie_embeddings", "rms_norm",
           "norm_epsilon", "d_intermediate", "attn_layer_idx", "attn_cfg")


def is_mamba_ssm(source: str | os.PathLike) -> bool:
    """Whether ``source`` is a local checkpoint in mamba_ssm's format."""
    config = Path(source) / "config.json"
    if not config.is_file():
        return False
    found = json.loads(config.read_text())
    return "d_model" in found and "n_layer" in found and "model_type" not in found


def problems(source: str | os.PathLike) -> list[str]:
    """Why a mamba_ssm checkpoint cannot become transformers' MambaForCausalLM (empty: it can)."""
    found = json.loads((Path(source) / "config.json").read_text())
    ssm = found.get("ssm_cfg") or {}
    out = []
    if ssm.get("layer", "Mamba1") != "Mamba1":
        out.append(f"ssm_cfg.layer={ssm['layer']!r}: a Mamba-2 checkpoint; transformers' Mamba2ForCausalLM reads a "
                   "converted one (its convert_mamba2_ssm_checkpoint script), model_type: Mamba2ForCausalLM")
    if found.get("rms_norm", True) is False:
        out.append("rms_norm: false: transformers' Mamba normalizes with RMSNorm only")
    if found.get("attn_layer_idx"):
        out.append(f"attn_layer_idx={found['attn_layer_idx']!r}: a hybrid with attention layers, not Mamba-1")
    unknown = sorted(set(ssm) - set(SSM_KEYS) - {"layer"})
    if unknown:
        out.append(f"ssm_cfg keys {unknown} have no transformers Mamba setting")
    if not (Path(source) / "pytorch_model.bin").is_file() and not (Path(source) / "model.safetensors").is_file():
        out.append("no pytorch_model.bin (mamba_ssm's weights file) or model.safetensors beside its config.json")
    return out


def hf_config(found: dict):
    from transformers import MambaConfig

    vocab, multiple = found["vocab_size"], found.get("pad_vocab_size_multiple", 8)
    if vocab % multiple:
        vocab += multiple - vocab % multiple  # mamba_ssm's padded embedding
    ssm = {SSM_KEYS[k]: v for k, v in (found.get("ssm_cfg") or {}).items() if k in SSM_KEYS}
    return MambaConfig(hidden_size=found["d_model"], num_hidden_layers=found["n_layer"], vocab_size=vocab,
                       layer_norm_epsilon=found.get("norm_epsilon", 1e-5),
                       residual_in_fp32=found.get("residual_in_fp32", True),
                       tie_word_embeddings=found.get("tie_embeddings", True), **ssm)


def convert(source: str | os.PathLike, out: str | os.PathLike) -> str:
    """A transformers MambaForCausalLM checkpoint of mamba_ssm checkpoint ``source`` in ``out`` (reused while it is
    complete); returns ``out``."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out)
    if (out / "done").is_file():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    found = json.loads((Path(source) / "config.json").read_text())
    config = hf_config(found)
    weights = (load_file(str(Path(source) / "model.safetensors")) if (Path(source) / "model.safetensors").is_file()
               else torch.load(Path(source) / "pytorch_model.bin", map_location="cpu", weights_only=True))
    weights = {("backbone.embeddings.weight" if k == "backbone.embedding.weight" else k): v.contiguous()
               for k, v in weights.items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the embedding's, tied (safetensors stores a tensor once)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["MambaForCausalLM"]
    config.save_pretrained(str(out))
    (out / "done").write_text(str(source))
    return str(out)
