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
  Under PP the pipeline's last stage adds them up from its logits during the training step
  (``return_token_stats``); 1.9 under CP, whose training logits are a sequence shard, takes one extra forward-only
  pass (full logits). ``num_tokens`` is added over the dp ranks (cp / tp / pp peers share a batch).
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


def aux_loss_enabled(trainer) -> bool:
    """TRL's aux_loss_enabled (SFTTrainer's, DPOTrainer's), which they set only after Trainer.__init__ (where adopt
    runs): a MoE text config (one with output_router_logits) and a non-zero coefficient (the args', else the
    config's)."""
    if hasattr(trainer, "aux_loss_enabled"):
        return bool(trainer.aux_loss_enabled)
    model = getattr(trainer, "model", None)
    text = model.config.get_text_config() if hasattr(getattr(model, "config", None), "get_text_config") else None
    if text is None or getattr(text, "output_router_logits", None) is None:
        return False
    coef = getattr(trainer.args, "router_aux_loss_coef", None)
    return (getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef) != 0.0


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
        (aux_loss_enabled(trainer), "the MoE router auxiliary loss (aux_loss_enabled)",
         "it is a load-balancing statistic of this rank's micro-batch, not of the global batch; set "
         "SFTConfig(router_aux_loss_coef=0.0)"),
        (bool(getattr(args, "use_liger_kernel", False)), "use_liger_kernel=True",
         "Liger's kernels compute the loss from this rank's tokens; use use_liger_kernel=False"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise NotImplementedError(f"TRL SFTTrainer with {what} under {where}: {fix}")
    if config.pp_size > 1 and config.pp_backend != "torch":
        raise NotImplementedError(
            f"TRL SFTTrainer with pp_backend={config.pp_backend!r}: its engine returns neither per-token outputs "
            "nor logits for the token accuracy and entropy; use pp_backend='torch'")
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


def _token_sums(trainer, model, inputs, outputs) -> tuple[torch.Tensor, str | None]:
    """[label tokens, correct top-1, entropy sum] (float64) and the mesh view to add them over (None: global)."""
    from nd_parallel.distributed.pipeline.torch_backend import token_stats

    if getattr(outputs, "token_stats", None) is not None:  # a pipeline training step: summed on the last stage
        return outputs.token_stats, None
    if getattr(outputs, "label_mask", None) is not None:  # TRL's fused head: this rank's tokens (a CP shard)
        sums = [outputs.label_mask.sum(), outputs.is_top1.sum(), outputs.entropy.detach().sum()]
        return torch.stack([s.to(torch.float64) for s in sums]), "dp_cp"
    logits = getattr(outputs, "logits", None)
    if logits is None or logits.shape[1] != inputs["labels"].shape[-1]:  # 1.9 under CP: a sequence shard
        with torch.no_grad():  # forward-only: the logits of the whole sequence, gathered
            logits = model(**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}).logits
    shifted = "shift_labels" in inputs
    return token_stats(logits, inputs["shift_labels" if shifted else "labels"], shifted), "dp"


def _all_reduce(trainer, tensor: torch.Tensor, dim: str | None) -> torch.Tensor:
    if dim is not None and trainer.accelerator.num_processes > 1:
        dist.all_reduce(tensor, group=trainer.nd_parallel.mesh[dim].get_group())
    return tensor


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """SFTTrainer.compute_loss with nd_parallel's global-token loss and global metrics (module docstring)."""
    # TRL picks its metrics bucket (here and in log()) from self.model.training; under PP the Trainer toggles
    # the prepared PipelineModel, not the HF model it was split from: carry the flag over.
    self.model.training = model.training
    mode = "train" if model.training else "eval"
    config = self.nd_parallel.config
    inputs = dict(inputs, use_cache=False)  # as TRL: no KV cache, so packed documents are masked apart
    inputs.pop("_prediction_loss_only", None)  # 1.9's prediction_step note to its own compute_loss, not an input
    if config.pp_size > 1 or config.cp_size > 1:
        for key in PACKED_ROW_KEYS:  # they describe the unsharded row (module docstring)
            inputs.pop(key, None)
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    if config.pp_size > 1:
        extra["return_token_stats"] = model.training and torch.is_grad_enabled()  # see PipelineModel.forward
    elif _has_fused_head(self):
        extra["fused_lm_head"] = True
    outputs = model(**inputs, **extra)
    loss = outputs.loss  # the global-token mean, the same value on every rank

    valid, correct, entropy = _all_reduce(self, *_token_sums(self, model, inputs, outputs)).tolist()
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
