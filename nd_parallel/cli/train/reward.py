"""`reward_model: true` / `process_reward_model: true` in `nd-parallel train`: what Axolotl runs for them, under
NDParallelCallback.

- **Reward model** (outcome): ``AutoModelForSequenceClassification`` (one score per sequence, pooled at its last
  non-pad token), trained by TRL's ``RewardTrainer`` on ``bradley_terry.chat_template`` pairs (data/reward.py):
  ``-logsigmoid(r_chosen - r_rejected)``, plus ``center_rewards_coefficient * mean((r_chosen + r_rejected)^2)``
  when set; plugins/trainer/reward.py makes it the mean over the global batch's pairs.
- **Process reward model**: ``AutoModelForTokenClassification`` (a label per token) on ``stepwise_supervised``
  records. Axolotl 0.19 runs TRL 1.9's ``PRMTrainer``, which TRL 1.16 (installed here) no longer has; that trainer
  only tokenized the data (done here by data/reward.py, as Axolotl's own strategy does) and took the Trainer's own
  loss, so its equivalent is ``transformers.Trainer`` with dropout disabled (PRMConfig's ``disable_dropout``) and a
  collator that pads labels with -100: the token-classification cross-entropy, made the global-token mean
  (labels not shifted) by nd_parallel's loss hooks. Not carried over: PRMTrainer's default ``compute_metrics``
  (token accuracy at evaluation); the evaluation loss is reported.

Axolotl's meaning of the keys: ``num_labels`` defaults to 1 (reward model) / 2 (process reward model);
``model_type`` defaults to the Auto class of each and may name a ``*ForSequenceClassification`` /
``*ForTokenClassification`` class of transformers (``cls_model_config``, objective.py, names the config class the
checkpoint's config is read with); ``pad_to_sequence_len`` defaults to true for a reward model; ``sequence_len``
cuts each sequence (``max_length``); the dataset keys ``step_separator``, ``max_completion_length`` and
``train_on_last_step_only`` shape the PRM's labels. Refused here: pipeline parallelism (the last stage does not get
the input_ids the head pools by, and computes a causal LM's loss), context parallelism for the PRM (CP shifts the
labels a token head reads unshifted; a reward model's pooled token is gathered: context_parallel/pooled_head.py),
sample packing, ``rl``, and datasets of another type (distributed/classification.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nd_parallel.distributed.classification import layout_problem

from .data.sources import REWARD_TYPES

_AXOLOTL_ONLY = "run the YAML with plain Axolotl"
KINDS = {"reward_model": ("sequence", REWARD_TYPES[0], 1), "process_reward_model": ("token", REWARD_TYPES[1], 2)}
CLASSES = {"sequence": "AutoModelForSequenceClassification", "token": "AutoModelForTokenClassification"}


@dataclass(kw_only=True)
class RewardOptions:
    reward_model: bool | None = None
    """Train a reward model (TRL's RewardTrainer on bradley_terry.chat_template pairs; reward.py)."""
    process_reward_model: bool | None = None
    """Train a process reward model (token classification on stepwise_supervised records)."""
    num_labels: int | None = None
    """The classification head's outputs. Default: 1 (reward_model), 2 (process_reward_model)."""
    center_rewards_coefficient: float | None = None
    """reward_model: weight of mean((r_chosen + r_rejected)^2) in the loss (TRL's; default none)."""


def reward_kind(t) -> str | None:
    """"sequence" (reward_model), "token" (process_reward_model) or None, for a TrainConfig or the YAML's dict."""
    get = t.get if isinstance(t, dict) else lambda key: getattr(t, key, None)
    return next((kind for key, (kind, _, _) in KINDS.items() if get(key)), None)


def _kind_refusals(d: dict) -> list[str]:
    out = [f"{key}={d[key]!r}; use true or false" for key in KINDS if d.get(key) not in (None, True, False)]
    if d.get("reward_model") and d.get("process_reward_model"):
        out.append("reward_model and process_reward_model are both set; a run trains one kind of head: keep one")
    if reward_kind(d) and d.get("rl") is not None:
        out.append(f"rl={d['rl']!r} with {'reward_model' if d.get('reward_model') else 'process_reward_model'}: "
                   "a run trains a policy or a reward model, not both; drop one")
    return out


def _type_refusals(d: dict, kind: str | None) -> list[str]:
    out = []
    for i, entry in enumerate(d.get("datasets") or []):
        typ = entry.get("type") if isinstance(entry, dict) else None
        owner = next((key for key, (_, t, _) in KINDS.items() if t == typ), None)
        if owner and kind != KINDS[owner][0]:
            out.append(f"datasets[{i}].type={typ!r} is a reward-model format: set {owner}: true, or use a "
                       "supervised type")
        elif kind is not None and owner is None:
            key, (_, want, _) = next((k, v) for k, v in KINDS.items() if v[0] == kind)
            out.append(f"datasets[{i}].type={typ!r} with {key}: its records are read as {want}; convert them, or "
                       + _AXOLOTL_ONLY)
    return out


def _model_refusals(d: dict, kind: str | None) -> list[str]:
    labels, out = d.get("num_labels"), []
    if labels is not None and (isinstance(labels, bool) or not isinstance(labels, int) or labels < 1):
        out.append(f"num_labels={labels!r}; write the head's number of outputs (an integer >= 1)")
    elif labels is not None and kind is None:
        out.append(f"num_labels={labels!r} sizes a classification head: set reward_model or process_reward_model, "
                   "or drop it (a causal LM's head is its vocabulary)")
    elif labels not in (None, 1) and kind == "sequence":
        out.append(f"num_labels={labels} with reward_model: RewardTrainer scores each sequence with one logit; set "
                   "num_labels: 1 (or drop it)")
    model_type = d.get("model_type")
    if kind is not None and model_type not in (None, CLASSES[kind]):
        suffix = CLASSES[kind].removeprefix("AutoModel")
        if not str(model_type).endswith(suffix):
            key = "reward_model" if kind == "sequence" else "process_reward_model"
            out.append(f"model_type={model_type!r} with {key}: the head is a {suffix.removeprefix('For')} one; use "
                       f"{CLASSES[kind]} (or drop model_type)")
    if d.get("center_rewards_coefficient") is not None:
        coef = d["center_rewards_coefficient"]
        if kind != "sequence":
            out.append("center_rewards_coefficient: only reward_model's RewardTrainer reads it; drop it or set "
                       "reward_model: true")
        elif isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
            out.append(f"center_rewards_coefficient={coef!r}; write a number >= 0 (TRL suggests 0.01)")
    return out


def reward_refusals(d: dict, layout) -> list[str]:
    """Refusal lines for the reward-model keys and what they cannot combine with, in the config stage; sets
    Axolotl's defaults in ``d`` (pad_to_sequence_len for a reward model)."""
    kind = reward_kind(d)
    out = _kind_refusals(d) + _type_refusals(d, kind) + _model_refusals(d, kind)
    if kind is None:
        return out
    if kind == "sequence" and d.get("pad_to_sequence_len") is None:  # Axolotl's hint_reward_model_pad
        d["pad_to_sequence_len"] = True
    key = "reward_model" if kind == "sequence" else "process_reward_model"
    if d.get("sample_packing"):
        out.append(f"sample_packing=True with {key}: its sequences are scored one by one, not packed; drop "
                   "sample_packing")
    if d.get("reinit_weights"):
        out.append(f"reinit_weights with {key}: the classification head is added to a pretrained checkpoint; drop "
                   "reinit_weights")
    problem = layout_problem(kind, layout) if layout is not None else None
    if problem:
        out.append(f"{key} with {problem}")
    return out


def auto_class(t, extra: dict):
    """The transformers class the rank loads ``t``'s model with: AutoModelForCausalLM, AutoModelForImageTextToText
    with a processor (multimodal.py), or a reward model's head; sets its num_labels in from_pretrained's keyword
    arguments ``extra`` (on ``extra["config"]`` when given: cls_model_config's, objective.py)."""
    import transformers

    kind = reward_kind(t)
    if kind is None:
        from .multimodal import image_text_class

        return transformers.AutoModelForImageTextToText if image_text_class(t) else transformers.AutoModelForCausalLM
    labels = t.num_labels or KINDS["reward_model" if kind == "sequence" else "process_reward_model"][2]
    if "config" in extra:
        extra["config"].num_labels = labels
    else:
        extra["num_labels"] = labels
    return getattr(transformers, t.model_type or CLASSES[kind])


def lora_task(t, targets):
    """(peft's task type, the LoRA targets) (Axolotl's _get_peft_task_type): a classification task keeps the head
    trainable in full (peft adds ``score`` / ``classifier`` to modules_to_save), so the head is left out of the
    targets (lora_target_linear lists every Linear but lm_head; peft refuses a module both adapted and saved)."""
    kind = reward_kind(t)
    if kind is None:
        return "CAUSAL_LM", targets
    if isinstance(targets, list):
        targets = [name for name in targets if name not in ("score", "classifier")]
    return ("SEQ_CLS" if kind == "sequence" else "TOKEN_CLS"), targets


def reward_trainer(t, trainer_args: dict, **kwargs):
    """RewardTrainer (reward_model) or the Trainer (process_reward_model) for ``t`` (module docstring)."""
    if reward_kind(t) == "sequence":
        pad = 64 * math.ceil(t.sequence_len / 64) if t.pad_to_sequence_len else None  # Axolotl's collator
        import trl

        args = trl.RewardConfig(**{"gradient_checkpointing": False, **trainer_args}, max_length=t.sequence_len,
                                center_rewards_coefficient=t.center_rewards_coefficient, pad_to_multiple_of=pad,
                                dataset_num_proc=None)
        return trl.RewardTrainer(args=args, **kwargs)
    from transformers import Trainer, TrainingArguments
    from trl.trainer.utils import disable_dropout_in_model

    from .data.collate import Collator

    disable_dropout_in_model(kwargs["model"])  # PRMConfig's disable_dropout (default true)
    token_mean_loss(kwargs["model"])
    pad_to = t.sequence_len if t.pad_to_sequence_len else None  # as the supervised runs (Axolotl: a multiple of 64)
    return Trainer(args=TrainingArguments(**trainer_args), data_collator=Collator(
        kwargs["processing_class"].pad_token_id, pad_to), **kwargs)


def token_mean_loss(model) -> None:
    """Make a token-classification model's loss honour ``num_items_in_batch``, in place.

    transformers' token-classification heads (5.x, ``GenericForTokenClassification``) take ``**kwargs`` but call
    their loss without them: the Trainer, seeing ``**kwargs``, passes the accumulated batch's token count and does
    not divide by the accumulation steps, and the model returns its micro-batch's mean, so with
    gradient_accumulation_steps > 1 the step's loss is the *sum* of the micro-batch means (TRL 1.9's PRMTrainer, which
    Axolotl runs, inherits this). Here the forward computes the same cross-entropy (unshifted labels, -100 ignored,
    fp32) divided by ``num_items_in_batch`` when given: the mean over the accumulated batch's label tokens, which
    nd_parallel's loss hooks then make the global batch's (distributed/loss.py)."""
    import functools

    import torch
    import torch.nn.functional as F

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    forward = base.forward

    @functools.wraps(forward)  # its signature stays the model's (the Trainer keeps the columns it names)
    def with_token_mean(*args, labels=None, num_items_in_batch=None, **kwargs):
        out = forward(*args, **kwargs)
        if labels is not None:
            logits = out.logits.float()
            labels = labels.to(logits.device)
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                    reduction="sum")
            count = (labels != -100).sum() if num_items_in_batch is None else num_items_in_batch
            out.loss = total / torch.as_tensor(count, device=total.device).to(total.dtype)
        return out

    base.forward = with_token_mean
