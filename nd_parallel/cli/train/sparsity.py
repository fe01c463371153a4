"""Axolotl's LLM Compressor plugin (``plugins: [axolotl.integrations.llm_compressor.LLMCompressorPlugin]`` with an
``llmcompressor: {recipe: ...}`` block): sparse fine-tuning that keeps a sparse checkpoint's zeros, with the meaning
of llm-compressor's ``ConstantPruningModifier``, the modifier Axolotl's example recipe runs:

- at the start of training, each targeted parameter gets a mask of its entries whose magnitude is above 1e-8
  (llm-compressor's epsilon): the zeros of a pruned checkpoint (2:4 or unstructured) are the masked-out entries;
- after every optimizer step the parameter is multiplied by its mask, so the pruned entries stay exactly zero while
  the others train (the optimizer's moments are not touched, as in llm-compressor).

Targets are llm-compressor's ``re:<regex>`` patterns (``re.match`` on the parameter's name, e.g.
``re:.*q_proj.weight``) or exact parameter names. Written by hand, not through llm-compressor (a large dependency
whose session drives a Trainer of its own): the modifier is these two steps. The masks are elementwise, so they hold
on each rank's piece of a parameter: FSDP2 / HSDP shards, TP slices, DDP and CP replicas; pipeline parallelism is
not checked and is refused. Other modifiers (SparseGPT, quantization, ...) and schedules (``start`` other than 0,
an ``end``) are refused with the fix. ``save_compressed: true`` (llm-compressor's compressed-tensors format): the
model is saved dense here, its zeros kept, said in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

EPSILON = 1e-8  # llm-compressor's ConstantPruningModifier: entries at or below it are the pruned ones
PLUGIN = "axolotl.integrations.llm_compressor.LLMCompressorPlugin"
MODIFIER = "ConstantPruningModifier"


@dataclass(kw_only=True)
class SparsityOptions:
    llmcompressor: dict | None = None
    """LLM Compressor's plugin block: {recipe: {stage: {<group>_modifiers: {ConstantPruningModifier: {targets}}}},
    save_compressed}: the targeted parameters keep their zeros (sparse fine-tuning)."""


def modifiers(recipe: Any) -> list[tuple[str, str, Any]]:
    """(stage, modifier name, its arguments) for every modifier of an llm-compressor recipe mapping."""
    out = []
    for stage, groups in (recipe or {}).items():
        for group, mods in (groups or {}).items() if isinstance(groups, dict) else []:
            if group.endswith("_modifiers") and isinstance(mods, dict):
                out += [(stage, name, args) for name, args in mods.items()]
    return out


def refusals(d: dict) -> list[str]:
    block = d.get("llmcompressor")
    if block is None:
        return []
    if not isinstance(block, dict) or not isinstance(block.get("recipe"), dict):
        return [f"llmcompressor={block!r}: write {{recipe: {{<stage>: {{<group>_modifiers: {{{MODIFIER}: {{targets: "
                "[...]}}}}}}, save_compressed: false}}"]
    out = [f"llmcompressor.{key}: not a key of the LLM Compressor plugin here; use recipe and save_compressed"
           for key in block if key not in ("recipe", "save_compressed")]
    if PLUGIN not in (d.get("plugins") or []):  # Axolotl reads the block only with its plugin listed
        out.append(f"llmcompressor={block!r}: the LLM Compressor plugin's block: list {PLUGIN} under plugins: (as "
                   "Axolotl requires), or drop it")
    found = modifiers(block["recipe"])
    if not found:
        out.append(f"llmcompressor.recipe has no modifier; give {MODIFIER} with its targets")
    for stage, name, args in found:
        where = f"llmcompressor.recipe.{stage}.{name}"
        if name != MODIFIER:
            out.append(f"{where}: only {MODIFIER} (sparse fine-tuning that keeps a checkpoint's zeros) runs here; "
                       "apply other modifiers (pruning, quantization) with llm-compressor before or after training")
            continue
        args = args or {}
        extra = sorted(set(args) - {"targets", "start", "end"})
        if extra:
            out.append(f"{where}: {', '.join(extra)} not supported; keep targets (and start: 0)")
        if args.get("start", 0) not in (0, 0.0, -1) or args.get("end", -1) not in (-1, None):
            out.append(f"{where}: start={args.get('start')!r}, end={args.get('end')!r}: the masks hold for the whole "
                       "run here; use start: 0 and no end")
        targets = args.get("targets")
        targets = [targets] if isinstance(targets, str) else targets
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
            out.append(f"{where}: targets={args.get('targets')!r}; write a list of 're:<regex>' patterns or "
                       "parameter names, e.g. ['re:.*q_proj.weight']")
            continue
        for target in targets:
            if target.startswith("re:"):
                try:
                    re.compile(target[3:])
                except re.error as err:
                    out.append(f"{where}: targets {target!r} is not a regular expression ({err})")
    return out


def check_layout(t: SparsityOptions, layout, path) -> None:
    from nd_parallel.config import ConfigError

    if t.llmcompressor and getattr(layout, "pp_size", 1) > 1:
        raise ConfigError(f"{path}: llmcompressor with pp_size={layout.pp_size}: the sparsity masks are checked under "
                          "FSDP2 / HSDP / DDP / TP / CP, not pipeline stages; use dp_shard_size or tp_size")


def notes(d: dict) -> list[str]:
    block = d.get("llmcompressor")
    if isinstance(block, dict) and block.get("save_compressed"):
        return ["llmcompressor.save_compressed: the model is saved dense (its zeros kept), not in llm-compressor's "
                "compressed-tensors format; compress it afterwards with llm-compressor if needed"]
    return []


def targets(t: SparsityOptions) -> list[str]:
    """Every target of the recipe's ConstantPruningModifiers."""
    out = []
    for _, _, args in modifiers((t.llmcompressor or {}).get("recipe")):
        value = (args or {}).get("targets")
        out += [value] if isinstance(value, str) else list(value or [])
    return out


def matches(name: str, patterns: list[str]) -> bool:
    """llm-compressor's matching: 're:<regex>' with re.match on the name, or the exact name."""
    return any(re.match(p[3:], name) if p.startswith("re:") else name == p for p in patterns)


def callbacks(t, trainer) -> list:
    """[the masking callback] when the YAML runs the LLM Compressor plugin's recipe."""
    if not t.llmcompressor:
        return []
    from transformers import TrainerCallback

    patterns = targets(t)

    class ConstantMasks(TrainerCallback):
        """Masks from the weights before the first step (of this run: a resumed run's weights keep their zeros),
        applied to this rank's piece of each targeted parameter after every optimizer step."""

        masks: list | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.masks is None:
                self.masks = [(p, _local(p).abs() > EPSILON) for name, p in trainer.model.named_parameters()
                              if p.requires_grad and matches(name, patterns)]
                if not self.masks:
                    raise ValueError(f"llmcompressor: targets {patterns} match no trainable parameter of the model")
            return control

        def on_step_end(self, args, state, control, **kwargs):
            import torch

            with torch.no_grad():
                for param, mask in self.masks or []:
                    _local(param).mul_(mask)
            return control

    return [ConstantMasks()]


def _local(param):
    """This rank's piece of a parameter (a DTensor's local shard; written in place)."""
    from torch.distributed.tensor import DTensor

    return (param.to_local() if isinstance(param, DTensor) else param).detach()
