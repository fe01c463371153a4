"""Classification heads on a Hugging Face decoder: reward models (``...ForSequenceClassification``: one score per
sequence, pooled at its last non-pad token) and process reward models (``...ForTokenClassification``: a label per
token, cross-entropy on *unshifted* labels).

Under FSDP2 / HSDP / DDP / TP they train as any model: the head is a Linear outside the model's tensor-parallel plan
(replicated under TP, sharded by FSDP with the root group) and the decoder is laid out as for the causal LM. Under
CP a sequence head's pooled token lives on one rank: context_parallel/pooled_head.py gathers it (transformers'
``score`` head only). Refused here, before any collective:

- **Pipeline parallelism.** The last stage receives hidden states only, not ``input_ids``, from which the sequence
  head finds the last non-pad token to pool; and the pipeline's loss is the causal LM's shifted cross-entropy.
- **Context parallelism for a token head.** CP shifts the labels before cutting them (the causal-LM convention),
  where a token-classification loss reads them unshifted; and a sequence head other than ``score``.

A sequence head called *with labels* (a plain Trainer's classification) returns its rank's mean over sequences,
which transformers computes without the global count: ``loss.GlobalTokenLoss`` refuses that at its first labelled
forward under dp or cp (TRL's RewardTrainer passes no labels; its pairwise loss is made global in plugins/trainer).
A token head's loss is the global-token mean, its labels counted unshifted.
"""

from __future__ import annotations

import torch.nn as nn

from nd_parallel.config import ParallelismConfig
from nd_parallel.models.peft import base_of

_USE = "use dp_shard_size, dp_replicate_size or tp_size"


def head_kind(model: nn.Module) -> str | None:
    """"sequence" (reward model), "token" (process reward model) or None (any other model), from its class, as
    transformers names its heads."""
    name = type(base_of(model)).__name__
    if name.endswith("ForSequenceClassification"):
        return "sequence"
    if name.endswith("ForTokenClassification"):
        return "token"
    return None


def layout_problem(kind: str, config: ParallelismConfig) -> str | None:
    """"pp_size=N: why; fix" (or cp_size) where ``config`` cannot train a ``kind`` head (module docstring)."""
    if config.pp_size > 1:
        why = ("its head pools each sequence's last non-pad token, found from input_ids, which the last pipeline "
               "stage does not receive" if kind == "sequence" else
               "the pipeline's last stage computes the causal LM's shifted cross-entropy, not the token-"
               "classification loss on unshifted labels")
        return f"pp_size={config.pp_size}: {why}; {_USE}"
    if config.cp_size > 1 and kind == "token":
        why = ("CP shifts the labels before cutting the sequence, as a causal LM's loss reads them, where a "
               "token-classification loss reads them unshifted")
        return f"cp_size={config.cp_size}: {why}; {_USE}"
    return None


def check_classification_layout(model: nn.Module, config: ParallelismConfig) -> None:
    """Refuse pipeline and context parallelism for a classification head (module docstring), naming the fix."""
    kind = head_kind(model)
    problem = layout_problem(kind, config) if kind is not None else None
    if problem is None and kind == "sequence" and config.cp_size > 1 and not isinstance(getattr(
            base_of(model), "score", None), nn.Module):  # context_parallel/pooled_head.py hooks transformers' head
        problem = (f"cp_size={config.cp_size}: its head is not transformers' `score` module, which context "
                   f"parallelism gathers and pools over the whole sequence; {_USE}")
    if problem:
        raise NotImplementedError(f"{type(base_of(model)).__name__} (a {kind}-classification head) under {problem}")
