"""TRL's ``SFTTrainer`` (1.9 - 1.16) under any layout: its loss and its metrics made global over the dp ranks.

What SFTTrainer does on its own, and why each part is turned here (adopt.py calls ``adopt_sft``):

- **Loss.** 1.16 adds a fused LM head (``add_fused_lm_head``: log-probs of the label tokens only, in tiles) and
  computes ``-sum(log_probs) / num_items_in_batch`` itself, with this rank's own token count; 1.9 calls the
  Trainer's loss and then reads ``outputs.logits``. Neither sees other dp ranks (gradients would be dp times too
  large: they are summed, not averaged), nor the sequence shards of CP, nor a pipeline (which returns no
  per-token output). Here the model is called with the Trainer's ``num_items_in_batch`` (this rank's label
  tokens over the accumulated micro-batches) and ``outputs.loss`` is taken: nd_parallel's hooks / pipeline make
  it the global-token mean of the whole accumulated batch (distributed/loss.py), the number one process gets.
  The fused head is used wherever TRL uses it, except under PP, whose stages run the model's own head and loss
  (the same cross-entropy, computed on the last stage without the tiling).
- **Metrics.** ``mean_token_accuracy`` and ``entropy`` are ratios of token sums; the sums are added over the
  ranks that hold different tokens (dp x cp) before dividing, so each is the value of the whole micro-batch.
  Without per-token outputs from the training forward (PP, or 1.9 under CP, where logits are a sequence shard)
  they come from one extra forward-only pass under ``no_grad`` (full logits, gathered). ``num_tokens`` is
  added over the dp ranks (cp / tp / pp peers share a batch).
- **Packing / padding_free.** The collator's ``cu_seq_lens_*`` / ``max_length_*`` / ``seq_idx`` describe the
  unsharded row; under CP and PP they are dropped and document boundaries come from ``position_ids`` (CP's
  attention and the pipeline's stages keep attention inside a document, as transformers does from the same
  position ids in one process).

Options that cannot be exact under a layout that splits the batch or the sequence are refused in
``check_sft_args``, before any collective.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

PACKED_ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def is_sft_trainer(trainer) -> bool:
    return any(cls.__name__ == "SFTTrainer" and cls.__module__.startswith("trl.") for cls in type(trainer).__mro__)


def _splits(config) -> dict:
    """Layout sizes that give ranks different tokens, or run the model as a pipeline (not tp)."""
    return {k: v for k, v in config.sizes.items() if k != "tp" and v > 1}


def _padding_free(args) -> bool:
    return bool(getattr(args, "padding_free", False) or (
        getattr(args, "packing", False) and getattr(args, "packing_strategy", "bfd") in ("bfd", "bfd_split")))


def check_sft_args(trainer, config) -> None:
    """SFTTrainer options whose loss is not the global-token mean under ``config``: refused with the fix."""
    args, splits = trainer.args, _splits(config)
    if not splits:
        return  # tp only: every rank holds the whole batch and sequence
    where = ", ".join(f"{k}_size={v}" for k, v in splits.items())
    refusals = [
        (getattr(trainer, "compute_loss_func", None) is not None, "compute_loss_func=<function>",
         "it is given this rank's logits and token count only; drop it (the loss is then the global-token mean)"),
        ((getattr(args, "label_smoothing_factor", 0) or 0) > 0,
         f"label_smoothing_factor={args.label_smoothing_factor}",
         "its loss divides by this rank's tokens; use label_smoothing_factor=0"),
        (getattr(args, "loss_type", "nll") != "nll", f"loss_type={getattr(args, 'loss_type', None)!r}",
         "only the token-mean negative log-likelihood is made global; use loss_type='nll'"),
        (bool(getattr(trainer, "aux_loss_enabled", False)), "the MoE router auxiliary loss (aux_loss_enabled)",
         "it is a load-balancing statistic of this rank's micro-batch, not of the global batch; set "
         "router_aux_loss_coef=0.0 in the model config"),
        (bool(getattr(args, "use_liger_kernel", False)), "use_liger_kernel=True",
         "Liger's kernels compute the loss from this rank's tokens; use use_liger_kernel=False"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise NotImplementedError(f"TRL SFTTrainer with {what} under {where}: {fix}")
    micro = config.microbatches if config.pp_size > 1 else 1
    if micro > 1 and _padding_free(args):
        raise ValueError(
            f"TRL SFTTrainer with padding_free (packing={getattr(args, 'packing', False)}, padding_free="
            f"{getattr(args, 'padding_free', False)}) puts each rank's batch into ONE row, which cannot be split "
            f"into pp_microbatches={micro}; use ParallelismConfig(pp_microbatches=1) (with pp_schedule='gpipe'), "
            "or packing=False and padding_free=False")


def adopt_sft(trainer, plugin) -> None:
    """Route this SFTTrainer's compute_loss through nd_parallel's loss (see the module docstring)."""
    check_sft_args(trainer, plugin.config)
    trainer.compute_loss = compute_loss.__get__(trainer)


def _has_fused_head(trainer) -> bool:
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "fused_lm_head" in inspect.signature(base.forward).parameters


def _token_sums(trainer, model, inputs, outputs) -> torch.Tensor:
    """[label tokens, correct top-1, entropy sum] of this rank's tokens (float64)."""
    if getattr(outputs, "label_mask", None) is not None:  # TRL's fused head
        sums = [outputs.label_mask.sum(), outputs.is_top1.sum(), outputs.entropy.detach().sum()]
        return torch.stack([s.to(torch.float64) for s in sums])
    labels = inputs.get("shift_labels")
    logits = getattr(outputs, "logits", None)
    full = inputs["labels"].shape[-1]
    if logits is None or logits.shape[1] != full:  # pipeline, or a CP sequence shard: one forward-only pass
        with torch.no_grad():
            logits = model(**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}).logits
    with torch.no_grad():
        if labels is None:
            logits, labels = logits[:, :-1], inputs["labels"][:, 1:]
        mask = labels != -100
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        correct = (logits.argmax(-1) == labels) & mask
        return torch.stack([mask.sum().double(), correct.sum().double(), (entropy * mask).sum().double()])


def _all_reduce(trainer, tensor: torch.Tensor, dim: str) -> torch.Tensor:
    if trainer.accelerator.num_processes > 1:
        dist.all_reduce(tensor, group=trainer.nd_parallel.mesh[dim].get_group())
    return tensor


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """SFTTrainer.compute_loss with nd_parallel's global-token loss and global metrics (module docstring)."""
    mode = "train" if self.model.training else "eval"
    config = self.nd_parallel.config
    inputs = dict(inputs, use_cache=False)  # as TRL: no KV cache, so packed documents are masked apart
    if config.pp_size > 1 or config.cp_size > 1:
        for key in PACKED_ROW_KEYS:  # they describe the unsharded row (module docstring)
            inputs.pop(key, None)
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    if config.pp_size == 1 and _has_fused_head(self):
        extra["fused_lm_head"] = True
    outputs = model(**inputs, **extra)
    loss = outputs.loss  # the global-token mean, the same value on every rank

    valid, correct, entropy = _all_reduce(self, _token_sums(self, model, inputs, outputs), "dp_cp").tolist()
    self._metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
    self._metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
    if mode == "train":
        if "attention_mask" in inputs:
            local = inputs["attention_mask"].sum()
        else:  # padding_free: one row of real tokens
            local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
        self._total_train_tokens += int(_all_reduce(self, local.to(torch.int64).clone(), "dp").item())
    self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
    if return_outputs:  # the logits for compute_metrics, as TRL: one more forward, without labels
        with torch.no_grad():
            outputs = model(**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")})
    return (loss, outputs) if return_outputs else loss
