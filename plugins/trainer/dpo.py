"""TRL's ``DPOTrainer`` (1.16) under FSDP2 / HSDP / DDP / TP / CP / EP: its loss the mean over the global batch's pairs.

What DPOTrainer does on its own, and why each part is turned here (adopt.py calls ``adopt_dpo``):

- **Log-probs.** It calls the model with ``fused_lm_head=True`` (``add_fused_lm_head``: per-token log-probs of the
  label tokens, in tiles, through the model's own head) for the policy and, with the adapter disabled (LoRA) or on
  its own reference copy, for the reference; it sums them per sequence. nd_parallel's chunked loss would take that
  call over (it runs the head itself), so it is turned off for this trainer: TRL's fused head already never holds
  the full logits. Under FSDP2 the head's weight is the all-gathered one inside the root group's forward; under TP
  TRL gathers the vocabulary-split head (``full_tensor``) and the gradient flows back to this rank's shard.
- **Loss.** Its loss is the mean over this rank's pairs of a per-pair function (sigmoid, hinge, IPO, ...).
  nd_parallel sums the data-parallel gradients (they are never averaged), so each rank's loss is rescaled to its
  share of the mean over the global batch's pairs, ``local_mean * local_pairs / global_pairs``, and the reported
  value is the sum of the shares over the dp ranks (``global_value_local_grad``): the number one process gets on
  the concatenated batch, with its gradients. tp (and ep) peers hold the same pairs.
- **Metrics.** Rewards, log-probs and margins go through ``accelerator.gather`` / ``gather_for_metrics``, which
  nd_parallel gathers over the dp ranks only: means over the global batch, as in one process.

- **Context parallelism.** Each cp rank's fused head scores its own tokens; CP's hooks gather those per-token fields
  back into the whole sequence (``context_parallel/token_outputs.py``), so every cp rank computes DPOTrainer's loss
  on whole sequences and backpropagates its own tokens' share.

Not handled (refused in ``check_dpo_args`` before any collective, with the fix): pipeline parallelism (the
per-sequence sums need a per-token output from the last stage, which the pipeline does not return),
loss types that mix pairs across the batch or average tokens (``aot``, ``aot_unpaired``, ``sft``) when dp splits
the batch, ``precompute_ref_log_probs`` (it runs inside ``DPOTrainer.__init__``, before the layout exists),
``sync_ref_model`` (it mixes sharded weights into the reference outside the layout), ``padding_free`` (one packed
row per rank, not verified under a layout), and the MoE router's auxiliary loss under dp or cp (a statistic of
this rank's micro-batch or tokens).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from nd_parallel.distributed.loss import global_value_local_grad

from .sft import aux_loss_enabled

logger = logging.getLogger("nd_parallel")

BATCH_MIXING_LOSSES = ("aot", "aot_unpaired", "sft")


def is_trl_trainer(trainer, name: str) -> bool:
    return any(cls.__name__ == name and cls.__module__.startswith("trl.") for cls in type(trainer).__mro__)


def is_dpo_trainer(trainer) -> bool:
    return is_trl_trainer(trainer, "DPOTrainer")


def check_dpo_args(trainer, config) -> None:
    """DPOTrainer options that cannot give one process's loss and gradients under ``config``: refused with the fix."""
    args = trainer.args
    losses = args.loss_type if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]
    mixing = [t for t in losses if t in BATCH_MIXING_LOSSES]
    refuse_trl_options(trainer, config, "DPOTrainer", [
        (bool(mixing) and config.dp_size > 1, f"loss_type={mixing!r}",
         "it sorts or averages over this rank's batch, which the dp ranks split; use a per-pair loss (sigmoid, "
         "hinge, ipo, ...) or one data-parallel rank"),
        (bool(getattr(args, "padding_free", False)), "padding_free=True",
         "one packed row per rank is not verified under a layout; use padding_free=False")])


PP_REASON = ("it sums each sequence's per-token log-probs from the model's fused head, which a pipeline's stages do "
             "not return")


def refuse_trl_options(trainer, config, name: str, own: list, pp_reason: str = PP_REASON) -> None:
    """Refuse, before any collective, the first of ``own`` + the options every TRL preference trainer shares here:
    pipeline parallelism (``pp_reason``: why), log-probs precomputed in __init__, a reference synced from the policy,
    the MoE router's auxiliary loss under dp or cp. Each item: (bad, what, fix)."""
    args = trainer.args
    if config.pp_size > 1:
        raise NotImplementedError(
            f"TRL {name} under pp_size={config.pp_size}: {pp_reason}; use dp_shard_size / dp_replicate_size / "
            f"tp_size / cp_size / ep_size for {name.removesuffix('Trainer')}")
    aux = aux_loss_enabled(trainer)
    refusals = own + [
        (bool(getattr(args, "precompute_ref_log_probs", False)), "precompute_ref_log_probs=True",
         f"it runs inside {name}.__init__, before the layout exists; leave it False (the reference forward "
         "then runs each step, under the layout)"),
        (bool(getattr(args, "sync_ref_model", False)), "sync_ref_model=True",
         "it mixes the policy's (sharded) weights into the reference outside the layout; leave it False"),
        (aux and config.dp_size * config.cp_size > 1, "the MoE router auxiliary loss (aux_loss_enabled)",
         f"it is a load-balancing statistic of this rank's micro-batch; set {name.removesuffix('Trainer')}"
         "Config(router_aux_loss_coef=0.0)"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise NotImplementedError(f"TRL {name} with {what} under {config.describe()}: {fix}")


def turn_off_chunked_loss(trainer, config) -> None:
    """TRL's fused head (DPOTrainer, KTOTrainer) computes the log-probs in tiles itself; the chunked loss would take
    its call over."""
    name = next((n for n in ("DPOTrainer", "KTOTrainer") if is_trl_trainer(trainer, n)), None)
    if name and config.loss_chunk_size not in (0, None):
        config.loss_chunk_size = 0
        logger.info(f"chunked loss off under TRL's {name} (its fused LM head computes the log-probs in tiles)")


def adopt_dpo(trainer, plugin) -> None:
    """Route this DPOTrainer's loss through the global-pair mean (see the module docstring)."""
    check_dpo_args(trainer, plugin.config)
    trainer.compute_loss = compute_loss.__get__(trainer)


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """DPOTrainer.compute_loss, its loss the mean over the global batch's pairs (module docstring)."""
    # chosen and rejected sequences are concatenated along the batch: half the rows are pairs
    return global_mean_loss(self, model, inputs, return_outputs, inputs["input_ids"].shape[0] // 2)


def global_mean_loss(self, model, inputs, return_outputs, count: int):
    """The trainer class's own compute_loss, whose loss is a mean over this rank's ``count`` examples, as this rank's
    share of the mean over the global batch's examples (``global_value_local_grad``)."""
    # CP: the fused head's per-token outputs of the whole sequence (token_outputs.py), the reference's too
    for m in (model, self.model, getattr(self, "ref_model", None)):
        if getattr(m, "_nd_parallel_cp", None) is not None:
            m._nd_parallel_cp.per_token_outputs = True
    out = type(self).compute_loss(self, model, inputs, return_outputs=return_outputs)
    loss, outputs = out if return_outputs else (out, None)
    loss = global_mean_share(self, loss, count)
    return (loss, outputs) if return_outputs else loss


def global_mean_share(trainer, loss, count: int):
    """``loss``, a mean over this rank's ``count`` examples, as this rank's share of the mean over the data-parallel
    ranks' examples: nd_parallel sums the dp gradients; the value is the global mean (``global_value_local_grad``).
    Unchanged without a layout or with one dp rank."""
    plugin = getattr(trainer, "nd_parallel", None)
    if plugin is None or plugin.config.dp_size == 1:
        return loss
    group = plugin.mesh["dp"].get_group()
    local = torch.tensor(count, dtype=torch.float32, device=loss.device)
    total = local.clone()
    dist.all_reduce(total, group=group)
    return global_value_local_grad(loss * (local / total), group)
