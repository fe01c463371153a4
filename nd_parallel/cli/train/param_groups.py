"""Axolotl 0.19's optimizer parameter groups in `nd-parallel train` (its trainers' OptimizerMixin), under every layout:

- ``loraplus_lr_ratio`` (LoRA+, arXiv 2402.12354): peft's ``create_loraplus_optimizer``, as Axolotl calls it: the
  ``lora_B`` factors (and 1-D parameters) at ``learning_rate x loraplus_lr_ratio``, LoRA on embeddings at
  ``loraplus_lr_embedding`` (default 1e-6), the rest at ``learning_rate``; as there, weight decay is peft's
  ``loraplus_weight_decay`` (0), not ``weight_decay``;
- ``embedding_lr_scale`` / ``embedding_lr``: parameters named ``embed_tokens`` / ``lm_head`` (and modules_to_save
  weights) at ``learning_rate x embedding_lr_scale`` (else ``embedding_lr``), without weight decay;
- ``lr_groups: [{name, modules, lr}]``: decayed parameters whose name contains one of a group's ``modules`` at that
  group's ``lr``.

``lr_scheduler_kwargs`` and ``optim_args`` reach TrainingArguments as Axolotl passes them.

With any of embedding_lr_scale / embedding_lr / lr_groups, the groups are Axolotl's: decayed parameters
(transformers' rule: not norms, not biases) with ``weight_decay``, embeddings, then the undecayed, then each lr
group. The learning-rate schedule scales each group's rate. Under a layout the groups are built from the prepared
model's parameters (FSDP2 / TP DTensors, a PP stage's own layers): a name keeps its module path (PP adds a
``stages.N.`` prefix, which the substring rules ignore).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from nd_parallel.config.sources import yaml_number

KEYS = ("loraplus_lr_ratio", "loraplus_lr_embedding", "embedding_lr", "embedding_lr_scale", "lr_groups")


@dataclass(kw_only=True)
class ParamGroupOptions:
    loraplus_lr_ratio: float | None = None
    """LoRA+: lora_B's learning rate over lora_A's (peft's create_loraplus_optimizer; the paper suggests 16)."""
    loraplus_lr_embedding: float | None = None
    """LoRA+: the learning rate of LoRA on embedding layers (default 1e-6)."""
    embedding_lr: float | None = None
    """The learning rate of embed_tokens / lm_head (Axolotl's embeddings group, no weight decay)."""
    embedding_lr_scale: float | None = None
    """embed_tokens / lm_head at learning_rate x this (wins over embedding_lr, as in Axolotl)."""
    lr_groups: list[dict] | None = None
    """[{name, modules: [substrings of parameter names], lr}]: decayed parameters at their group's rate."""
    lr_scheduler_kwargs: dict | None = None
    """Keyword arguments of the learning-rate schedule (TrainingArguments.lr_scheduler_kwargs, as Axolotl passes
    them; e.g. num_cycles for cosine)."""
    optim_args: str | dict | None = None
    """Extra optimizer arguments, "k=v,k=v" or a mapping (TrainingArguments.optim_args, as Axolotl passes them)."""


def trainer_args(t: ParamGroupOptions, scheduler: dict) -> dict:
    """TrainingArguments for lr_scheduler_kwargs (merged over ``scheduler``'s, e.g. the cosine floor's min_lr_rate)
    and optim_args (a mapping written "k=v,..." as Axolotl writes it)."""
    out = {}
    if t.lr_scheduler_kwargs:
        out["lr_scheduler_kwargs"] = {**scheduler.get("lr_scheduler_kwargs", {}), **t.lr_scheduler_kwargs}
    if t.optim_args:
        args = t.optim_args
        out["optim_args"] = ",".join(f"{k}={v}" for k, v in args.items()) if isinstance(args, dict) else args
    return out


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def refusals(d: dict) -> list[str]:
    """The keys' checks (numbers made numbers in ``d``, in place); refusal lines."""
    for key in KEYS[:4]:
        if d.get(key) is not None:
            d[key] = yaml_number(d[key])
    for group in d.get("lr_groups") or []:
        if isinstance(group, dict) and "lr" in group:
            group["lr"] = yaml_number(group["lr"])
    out = [f"{k}={d[k]!r}: write a number > 0" for k in KEYS[:4] if d.get(k) is not None and not _positive(d[k])]
    for key, kinds in (("lr_scheduler_kwargs", dict), ("optim_args", (str, dict))):
        if d.get(key) is not None and not isinstance(d[key], kinds):
            out.append(f"{key}={d[key]!r}: write a mapping" + (" or 'k=v,k=v'" if key == "optim_args" else ""))
    groups = d.get("lr_groups")
    if groups is not None:
        ok = isinstance(groups, list) and all(
            isinstance(g, dict) and isinstance(g.get("name"), str) and _positive(g.get("lr")) and isinstance(
                g.get("modules"), list) and g["modules"] and all(isinstance(m, str) for m in g["modules"])
            for g in groups)
        if not ok:
            out.append(f"lr_groups={groups!r}: write a list of {{name: attn, modules: [self_attn], lr: 1e-4}}")
    if d.get("loraplus_lr_ratio") is not None and d.get("adapter") not in ("lora", "qlora"):
        out.append(f"loraplus_lr_ratio with adapter={d.get('adapter')!r}: LoRA+ sets the rates of LoRA factors; "
                   "set adapter: lora (or qlora), or drop it")
    if d.get("optimizer") == "muon" and any(d.get(k) is not None for k in KEYS):
        out.append("optimizer: muon with LoRA+ / embedding_lr / lr_groups: Muon builds its own groups (matrices vs "
                   "the rest); drop one")
    return out


def used(t: ParamGroupOptions) -> bool:
    return any(getattr(t, k) is not None for k in KEYS if k != "loraplus_lr_embedding")


def groups(model, trainer, t: ParamGroupOptions, lr: float) -> list[dict]:
    """Axolotl's create_optimizer_grouped_parameters (module docstring), for ``model``'s trainable parameters."""
    decayed = set(trainer.get_decay_parameter_names(model))
    lookup = {m: g["name"] for g in t.lr_groups or [] for m in g["modules"]}
    parts: dict[str, list] = {"decay": [], "embeddings": [], "no_decay": [], **{g["name"]: [] for g in
                                                                                  t.lr_groups or []}}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith("modules_to_save.default.weight") or "embed_tokens" in name or "lm_head" in name:
            parts["embeddings"].append(param)
        elif name in decayed:
            found = [m for m in lookup if m in name]
            parts[lookup[found[0]] if found else "decay"].append(param)
        else:
            parts["no_decay"].append(param)
    embedding_lr = lr * t.embedding_lr_scale if t.embedding_lr_scale else t.embedding_lr or lr
    decay = trainer.args.weight_decay
    out = [{"params": parts["decay"], "weight_decay": decay, "lr": lr},
           {"params": parts["embeddings"], "weight_decay": 0.0, "lr": embedding_lr},
           {"params": parts["no_decay"], "weight_decay": 0.0, "lr": lr}]
    out += [{"params": parts[g["name"]], "weight_decay": decay, "lr": g["lr"]} for g in t.lr_groups or []]
    return [g for g in out if g["params"]]


def use_param_groups(trainer, t: ParamGroupOptions) -> None:
    """The Trainer builds its optimizer (class and settings from TrainingArguments) over these groups."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            net = self.model if model is None else model
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, net)
            if t.loraplus_lr_ratio is not None:  # Axolotl calls peft's helper with the optimizer's own kwargs
                from peft.optimizers import create_loraplus_optimizer

                self.optimizer = create_loraplus_optimizer(
                    net, cls, loraplus_lr_ratio=t.loraplus_lr_ratio,
                    loraplus_lr_embedding=t.loraplus_lr_embedding or 1e-6, **kwargs)
            else:
                self.optimizer = cls(groups(net, self, t, kwargs["lr"]), **kwargs)
        return self.optimizer

    trainer.create_optimizer = types.MethodType(create_optimizer, trainer)
