"""`rl: dpo` / `rl: ipo` / `rl: kto` / `rl: orpo` in `nd-parallel train`: TRL's DPOTrainer / KTOTrainer /
ORPOTrainer (what Axolotl runs for them) with NDParallelCallback (plugins/trainer/dpo.py, kto.py and orpo.py make
their loss that of the global batch), on the strings data/preference.py (prompt / chosen / rejected, from Axolotl's
``chat_template.default`` records), data/orpo.py (the same, from its ``chat_template.argilla`` records) or
data/kto.py (prompt / completion / label, Axolotl's KTO types) renders.

Axolotl's meaning: ``rl_beta`` is the trainer's beta (TRL's default 0.1 when unset), ``sequence_len`` its
``max_length`` (prompt + answer, truncated as TRL does), ``rl: ipo`` DPOTrainer with the IPO loss,
``kto_desirable_weight`` / ``kto_undesirable_weight`` KTO's weights of the two labels (default 1.0), ``orpo_alpha``
ORPO's beta where ``rl_beta`` is unset (the weight of its odds-ratio term; ORPO has no reference model). The reference
policy is the base with the adapter disabled under LoRA, or the trainer's own frozen copy under full fine-tuning,
prepared under the same layout. ``rl: grpo`` / ``gdpo`` / ``ebft`` are grpo.py's; Axolotl's other RL trainer (simpo)
is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass

from nd_parallel.config.sources import yaml_number

from . import grpo
from .data.dpo_types import TYPES as TEMPLATE_DPO_TYPES
from .data.kto import TYPES as KTO_TYPES
from .data.orpo import TYPES as ORPO_TYPES

# rl -> DPOConfig(loss_type=...); kto -> KTOTrainer
LOSSES = {"dpo": ["sigmoid"], "ipo": ["ipo"]}
RL = (*LOSSES, "kto", "orpo", "simpo")
_AXOLOTL_ONLY = "run the YAML with Axolotl and the nd_parallel plugin (docs/axolotl.md)"
_DPO_TYPES = ("chat_template", "chat_template.default", *TEMPLATE_DPO_TYPES)
SUPERVISED_NOT = (*KTO_TYPES, *TEMPLATE_DPO_TYPES, *ORPO_TYPES)  # preference formats: refused without rl


@dataclass(kw_only=True)
class PreferenceOptions:
    rl: str | None = None
    """dpo, ipo, kto or orpo: train on preferences with TRL's DPOTrainer / KTOTrainer / ORPOTrainer (preference.py);
    None = supervised."""
    rl_beta: float | None = None
    """The trainer's beta, how far the policy may move from the reference (TRL's default 0.1)."""
    kto_desirable_weight: float | None = None
    """rl: kto: weight of the desirable examples' losses (default 1.0)."""
    kto_undesirable_weight: float | None = None
    """rl: kto: weight of the undesirable examples' losses (default 1.0)."""
    orpo_alpha: float | None = None
    """rl: orpo: the weight of the odds-ratio term (TRL's beta; rl_beta wins where both are set; default 0.1)."""
    dpo_loss_type: str | list[str] | None = None
    """rl: dpo: DPOConfig's loss_type (sigmoid, hinge, ipo, robust, sft, ... or a list combined by dpo_loss_weights)."""
    dpo_loss_weights: list[float] | None = None
    """rl: dpo: one weight per dpo_loss_type (DPOConfig's loss_weights)."""
    dpo_label_smoothing: float | None = None
    """rl: dpo: DPOConfig's label_smoothing (robust / conservative DPO), in [0, 0.5)."""
    dpo_use_weighting: bool | None = None
    """rl: dpo / ipo: DPOConfig's use_weighting (WPO's per-pair weights)."""
    dpo_use_liger_kernel: bool | None = None
    """Liger's fused DPO loss (a Triton kernel): the same loss runs without it here (one line)."""
    cpo_alpha: float | None = None
    """rl: simpo: the weight of the chosen answers' NLL term (CPOConfig's cpo_alpha; TRL's default 1.0)."""
    simpo_gamma: float | None = None
    """rl: simpo: SimPO's target reward margin (CPOConfig's simpo_gamma); required, as in Axolotl."""
    precompute_ref_log_probs: bool = False
    """rl: dpo / ipo / kto: TRL computes the reference log-probs once before training (in eval mode); here they are
    computed each step under the layout, the same values for a model without dropout (others are refused)."""


def _positive(d: dict, key: str, default: str) -> list[str]:
    value = d.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        return [f"{key}={value!r}; write a number > 0 ({default})"]
    return []


def _kind(kind: str) -> str:
    """The trainer(s) a preference type is read by, with its article: "a KTO", "an ORPO", ..."""
    if kind in ORPO_TYPES:
        return "an ORPO"
    both = kind in KTO_TYPES and kind in TEMPLATE_DPO_TYPES  # e.g. chatml.intel: Axolotl has it for both trainers
    return "a DPO or KTO" if both else "a KTO" if kind in KTO_TYPES else "a DPO"


def _type_refusals(d: dict, rl: str) -> list[str]:
    out, entries = [], d.get("datasets") or []
    if rl is None:  # a preference type in a supervised run
        return [f"datasets[{i}].type={e['type']!r} is {_kind(e['type'])} format: set rl: "
                f"{_kind(e['type']).split(' ', 1)[1].lower().replace(' or ', ' or rl: ')}, or use a supervised type"
                for i, e in enumerate(entries) if isinstance(e, dict) and e.get("type") in SUPERVISED_NOT]
    for i, entry in enumerate(entries):
        kind = entry.get("type") if isinstance(entry, dict) else None
        if rl == "kto" and kind not in KTO_TYPES:
            out.append(f"datasets[{i}].type={kind!r} with rl: kto: KTO examples are read as Axolotl's KTO types "
                       f"({', '.join(KTO_TYPES)}); convert them, or " + _AXOLOTL_ONLY)
        elif rl == "orpo" and kind not in ORPO_TYPES:
            out.append(f"datasets[{i}].type={kind!r} with rl: orpo: ORPO pairs are read as Axolotl's "
                       "chat_template.argilla (chosen / rejected conversations); convert them, or " + _AXOLOTL_ONLY)
        elif rl not in ("kto", "orpo") and kind not in _DPO_TYPES:
            out.append(f"datasets[{i}].type={kind!r} with rl: {rl}: preference records are read as Axolotl's "
                       "chat_template.default (field_messages, field_chosen, field_rejected) or its template types "
                       f"({', '.join(TEMPLATE_DPO_TYPES)}); convert them, or " + _AXOLOTL_ONLY)
    return out


def _orpo_refusals(d: dict, rl: str) -> list[str]:
    if rl == "orpo":
        return _positive(d, "orpo_alpha", "TRL's default 0.1")
    if d.get("orpo_alpha") is not None:
        return [f"orpo_alpha with rl: {rl}: it weighs ORPO's odds-ratio term; drop it or set rl: orpo"]
    return []


DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")  # TRL's DPOConfig


def _simpo_refusals(d: dict, rl: str) -> list[str]:
    """rl: simpo: Axolotl passes simpo_gamma as it is (TRL's SimPO loss divides it by beta, so unset it fails on the
    first step there) and cpo_alpha when set."""
    keys = [k for k in ("cpo_alpha", "simpo_gamma") if d.get(k) is not None]
    if rl != "simpo":
        return [f"{k} with rl: {rl}: a SimPO (CPOTrainer) setting; drop it or set rl: simpo" for k in keys]
    out = [f"{k}={d[k]!r}: write a number" for k in keys
           if isinstance(d[k], bool) or not isinstance(d[k], (int, float))]
    if d.get("simpo_gamma") is None:
        out.append("rl: simpo without simpo_gamma: Axolotl passes it unset to TRL, whose SimPO loss then fails on the "
                   "first step; set simpo_gamma (TRL's default 0.5)")
    return out


def _dpo_refusals(d: dict, rl: str) -> list[str]:
    """Axolotl's dpo_* keys (its DPOStrategy): loss types and weights, label smoothing for rl: dpo only."""
    if d.get("dpo_label_smoothing") is not None:
        d["dpo_label_smoothing"] = yaml_number(d["dpo_label_smoothing"])
    used = [k for k in ("dpo_loss_type", "dpo_loss_weights", "dpo_label_smoothing", "dpo_use_weighting",
                        "dpo_use_liger_kernel") if d.get(k) is not None]
    if used and rl not in ("dpo", "ipo"):
        return [f"{k} with rl: {rl}: a DPOTrainer setting; drop it or set rl: dpo" for k in used]
    out = []
    types = d.get("dpo_loss_type")
    listed = [types] if isinstance(types, str) else types
    if types is not None and not (isinstance(listed, list) and listed and all(t in DPO_LOSSES for t in listed)):
        out.append(f"dpo_loss_type={types!r}: use one of {', '.join(DPO_LOSSES)} (or a list of them)")
    weights = d.get("dpo_loss_weights")
    if weights is not None and (not isinstance(weights, list) or len(weights) != len(listed or ["sigmoid"]) or not
                                all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)):
        out.append(f"dpo_loss_weights={weights!r}: write one number per dpo_loss_type ({len(listed or [1])})")
    smoothing = d.get("dpo_label_smoothing")
    if smoothing is not None and (isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or
                                  not 0 <= smoothing < 0.5):
        out.append(f"dpo_label_smoothing={smoothing!r}: write a number in [0, 0.5)")
    others = [t for t in listed or [] if t != "sigmoid"]
    if d.get("dpo_use_weighting") and others:  # TRL 1.16 raises on it (found here): sft, hinge, ...
        out.append(f"dpo_use_weighting with dpo_loss_type {others}: TRL's DPOTrainer multiplies the per-pair loss by "
                   "the WPO weights in place, which breaks the backward (or the expanded tensor) of those losses; use "
                   "it with the sigmoid loss, or drop it")
    if rl == "ipo" and (types is not None or smoothing):  # Axolotl: ipo's loss is ipo, without smoothing
        out.append("dpo_loss_type / dpo_label_smoothing with rl: ipo: IPO's loss is fixed; set rl: dpo to choose it")
    return out


def dpo_args(t) -> dict:
    """DPOConfig arguments of Axolotl's dpo_* keys (its DPOStrategy.set_training_args_kwargs)."""
    out = {"loss_type": LOSSES[t.rl]}
    if t.rl == "dpo" and t.dpo_loss_type is not None:
        out["loss_type"] = [t.dpo_loss_type] if isinstance(t.dpo_loss_type, str) else list(t.dpo_loss_type)
    if t.rl == "dpo" and t.dpo_loss_weights is not None:
        out["loss_weights"] = [float(w) for w in t.dpo_loss_weights]
    if t.rl == "dpo" and t.dpo_label_smoothing:
        out["label_smoothing"] = float(t.dpo_label_smoothing)
    if t.dpo_use_weighting is not None:
        out["use_weighting"] = bool(t.dpo_use_weighting)
    return out


def rl_refusals(d: dict, layout, path) -> list[str]:
    """Refusal lines for ``rl`` and what it cannot combine with, in the config stage."""
    rl = d.get("rl")
    if rl in grpo.RL:
        return grpo.refusals(d, layout, path) + _positive(d, "rl_beta", "TRL's GRPO default 0: no KL term")
    out = [f"trl: with rl: {rl}: the block is read with rl: grpo / gdpo / ebft here; for rl: {rl} write rl_beta"
           ] if d.get("trl") else []
    if rl is None:
        unused = ["precompute_ref_log_probs without rl: it sets how a preference trainer's reference is computed; "
                  "drop it"] if d.get("precompute_ref_log_probs") else []
        return out + _type_refusals(d, None) + unused
    if rl not in RL:
        return out + [f"rl={rl!r}: nd-parallel train runs rl: dpo, ipo (TRL's DPOTrainer), kto (TRL's KTOTrainer), "
                      "orpo (TRL's ORPOTrainer), simpo (TRL's CPOTrainer), grpo, gdpo and ebft (TRL's GRPOTrainer); "
                      "for Axolotl's other RL "
                      "trainers " + _AXOLOTL_ONLY]
    out += _positive(d, "rl_beta", "TRL's default 0.1") + _type_refusals(d, rl) + _orpo_refusals(d, rl)
    out += _dpo_refusals(d, rl) + _simpo_refusals(d, rl)
    if d.get("precompute_ref_log_probs") and rl not in (*LOSSES, "kto"):
        out.append(f"precompute_ref_log_probs with rl: {rl}: that trainer has no reference model; drop it")
    if rl == "kto":
        out += _positive(d, "kto_desirable_weight", "default 1.0") + _positive(d, "kto_undesirable_weight",
                                                                               "default 1.0")
        batch = d.get("micro_batch_size") or 1
        if isinstance(batch, int) and batch < 2:  # TRL's own rule, which KTOTrainer raises on the ranks
            out.append(f"micro_batch_size={batch} with rl: kto: KTO estimates its KL term "
                       "from the other examples of a micro-batch; set micro_batch_size: 2 or more")
    else:
        for key in ("kto_desirable_weight", "kto_undesirable_weight"):
            if d.get(key) is not None:
                out.append(f"{key} with rl: {rl}: it weighs KTO's examples; drop it or set rl: kto")
    if d.get("sample_packing"):
        out.append(f"sample_packing=True with rl: {rl}: preference examples are not packed; drop sample_packing")
    if layout is not None and layout.pp_size > 1:
        why = ("builds its loss from the whole logits after the forward" if rl in ("orpo", "simpo") else
               "sums each sequence's per-token log-probs")
        out.append(f"rl: {rl} with pipeline_parallel_size: {layout.pp_size}: {rl.upper()} {why}, which a pipeline's "
                   "stages do not return; use dp_shard_size, tensor_parallel_size, context_parallel_size or "
                   "expert_parallel_size")
    return out


def check_precompute(t, model) -> None:
    """precompute_ref_log_probs: TRL's precomputed reference (eval mode, before training) equals the reference
    forward each step only where no dropout acts in training (a LoRA adapter's dropout is off in the reference)."""
    if not t.precompute_ref_log_probs or model is None:
        return
    import torch.nn as nn

    from nd_parallel.config import ConfigError

    active = sorted({name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0
                     and "lora_dropout" not in name})
    if active:
        raise ConfigError(f"precompute_ref_log_probs with a model that applies dropout in training ({active[0]}, "
                          f"... {len(active)} modules): TRL's precomputed reference (eval mode) differs from the "
                          "per-step one computed here; drop precompute_ref_log_probs, or load the model with its "
                          "dropout at 0 (model_config)")


def preference_trainer(t, trainer_args: dict, **kwargs):
    """TRL's DPOTrainer / KTOTrainer / ORPOTrainer for ``t`` (a TrainConfig with rl set): the Trainer's arguments plus
    its own."""
    import trl

    # TRL's configs turn checkpointing on by default; the YAML's gradient_checkpointing already reached the layout
    common = {"gradient_checkpointing": False, "activation_checkpointing": False, **trainer_args,
              "beta": 0.1 if t.rl_beta is None else float(t.rl_beta), "max_length": t.sequence_len,
              "dataset_num_proc": None}
    if t.rl == "orpo":  # Axolotl: rl_beta, else orpo_alpha, is ORPOConfig's beta
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        beta = t.rl_beta if t.rl_beta is not None else t.orpo_alpha
        return ORPOTrainer(args=ORPOConfig(**{**common, "beta": 0.1 if beta is None else float(beta)}), **kwargs)
    if t.rl == "simpo":  # Axolotl: TRL's CPOTrainer with loss_type simpo, simpo_gamma, cpo_alpha when set
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        alpha = {} if t.cpo_alpha is None else {"cpo_alpha": float(t.cpo_alpha)}
        return CPOTrainer(args=CPOConfig(**common, loss_type="simpo", simpo_gamma=float(t.simpo_gamma), **alpha),
                          **kwargs)
    if t.rl == "kto":
        check_precompute(t, kwargs.get("model"))
        args = trl.KTOConfig(**common, desirable_weight=float(t.kto_desirable_weight or 1.0),
                             undesirable_weight=float(t.kto_undesirable_weight or 1.0))
        return trl.KTOTrainer(args=args, **kwargs)
    check_precompute(t, kwargs.get("model"))
    return trl.DPOTrainer(args=trl.DPOConfig(**common, **dpo_args(t)), **kwargs)
