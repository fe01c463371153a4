"""`rl: dpo` / `rl: ipo` in `nd-parallel train`: TRL's DPOTrainer (what Axolotl runs for them) with NDParallelCallback
(plugins/trainer/dpo.py makes its loss the mean over the global batch's pairs), on the prompt / chosen / rejected
strings data/preference.py renders from Axolotl's ``chat_template.default`` records.

Axolotl's meaning: ``rl_beta`` is DPO's beta (TRL's default 0.1 when unset), ``sequence_len`` DPOTrainer's
``max_length`` (prompt + answer, truncated as TRL does), ``rl: ipo`` DPOTrainer with the IPO loss. The reference
policy is the base with the adapter disabled under LoRA, or DPOTrainer's own frozen copy under full fine-tuning,
prepared under the same layout. Axolotl's other RL trainers (kto, orpo, simpo, grpo, gdpo, ebft) are refused here.
"""

from __future__ import annotations

from dataclasses import dataclass

# rl -> DPOConfig(loss_type=...)
LOSSES = {"dpo": ["sigmoid"], "ipo": ["ipo"]}
_AXOLOTL_ONLY = "run the YAML with Axolotl and the nd_parallel plugin (docs/axolotl.md)"


@dataclass(kw_only=True)
class PreferenceOptions:
    rl: str | None = None
    """dpo or ipo: train on preference pairs with TRL's DPOTrainer (preference.py); None = supervised."""
    rl_beta: float | None = None
    """DPO's beta, how far the policy may move from the reference (TRL's default 0.1)."""


def rl_refusals(d: dict, layout) -> list[str]:
    """Refusal lines for ``rl`` and what it cannot combine with, in the config stage."""
    rl = d.get("rl")
    if rl is None:
        return []
    if rl not in LOSSES:
        return [f"rl={rl!r}: nd-parallel train runs rl: dpo and rl: ipo (TRL's DPOTrainer); for Axolotl's other "
                f"RL trainers {_AXOLOTL_ONLY}"]
    out = []
    beta = d.get("rl_beta")
    if beta is not None and (isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0):
        out.append(f"rl_beta={beta!r}; write a number > 0 (TRL's default 0.1)")
    if d.get("sample_packing"):
        out.append(f"sample_packing=True with rl: {rl}: DPO's pairs are not packed; drop sample_packing")
    for i, entry in enumerate(d.get("datasets") or []):
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind not in ("chat_template", "chat_template.default"):
            out.append(f"datasets[{i}].type={kind!r} with rl: {rl}: preference records are read as Axolotl's "
                       "chat_template.default (field_messages, field_chosen, field_rejected); convert them, or "
                       + _AXOLOTL_ONLY)
    if layout is not None:
        if layout.pp_size > 1:
            out.append(f"rl: {rl} with pipeline_parallel_size: {layout.pp_size}: DPO sums each sequence's "
                       "per-token log-probs, which a pipeline's stages do not return; use dp_shard_size, "
                       "tensor_parallel_size, context_parallel_size or expert_parallel_size")
    return out


def dpo_trainer(t, trainer_args: dict, **kwargs):
    """TRL's DPOTrainer for ``t`` (a TrainConfig with rl set): the Trainer's arguments plus DPO's."""
    from trl import DPOConfig, DPOTrainer

    # DPOConfig turns checkpointing on by default; the YAML's gradient_checkpointing already reached the layout
    checkpointing = {"gradient_checkpointing": False, "activation_checkpointing": False}
    args = DPOConfig(**{**checkpointing, **trainer_args}, beta=0.1 if t.rl_beta is None else float(t.rl_beta),
                     loss_type=LOSSES[t.rl], max_length=t.sequence_len, dataset_num_proc=None)
    return DPOTrainer(args=args, **kwargs)
