"""What every pipeline backend checks and counts at the start of a training step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nd_parallel.distributed.loss import count_label_tokens


def check_step_inputs(input_ids: torch.Tensor, labels, unused: dict, microbatches: int,
                      labels_required: bool = True) -> None:
    extra = {k for k, v in unused.items() if v is not None}
    if extra:
        raise NotImplementedError(f"under pipeline parallelism the model takes input_ids, labels, attention_mask "
                                  f"and position_ids; got also {sorted(extra)}")
    if labels is None and labels_required:
        raise ValueError("under pipeline parallelism a forward in training mode is a training step: pass labels, "
                         "or call model.eval() (and torch.no_grad()) for a forward-only pass that returns logits")
    if input_ids.shape[0] % microbatches:
        raise ValueError(
            f"the batch of {input_ids.shape[0]} samples per data-parallel rank cannot be split into "
            f"pp_microbatches={microbatches}; use a per-rank batch size that is a multiple of {microbatches}")


def global_label_tokens(labels: torch.Tensor, mesh, num_items_in_batch=None, shifted: bool = False) -> torch.Tensor:
    """Label tokens of the whole global batch (every micro-batch, dp and cp rank); at least 1.

    With gradient accumulation the caller passes this rank's label tokens over every call of the optimizer
    step (HF's ``num_items_in_batch`` convention), so that each call's loss is its share of the step's mean.
    """
    if num_items_in_batch is not None:  # counts the rank's whole batch, which its cp peers share
        local, group = num_items_in_batch, mesh["dp"].get_group()
    else:  # shifted: context parallelism already shifted the labels and cut them into sequence shards
        local = (labels != -100).sum() if shifted else count_label_tokens(labels)
        group = mesh["dp_cp"].get_group()
    total = torch.as_tensor(local, device=labels.device, dtype=torch.int64).reshape(()).clone()
    dist.all_reduce(total, group=group)
    return total.clamp(min=1)
