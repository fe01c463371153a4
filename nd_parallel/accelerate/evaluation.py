"""``accelerator.gather`` / ``gather_for_metrics`` under a layout: over the data-parallel ranks only.

tp, cp and pp peers hold the same samples (and, after an evaluation forward, the same logits): a world-wide
gather would repeat each sample tp·cp·pp times. The collectives are ``nd_parallel.distributed.evaluation``'s.
"""

from __future__ import annotations

import torch

from nd_parallel.distributed.evaluation import gather_objects_over, gather_over


def gather(accelerator, original, dp_group, tensor):
    """Tensors (or a list of objects) over the dp ranks; Accelerate's own where nothing is split."""
    if dp_group is None:
        return original(tensor)
    if isinstance(tensor, list) and tensor and not isinstance(tensor[0], torch.Tensor):
        return gather_objects_over(tensor, dp_group)
    return gather_over(tensor, dp_group)


def gather_for_metrics(accelerator, original, dp_group, input_data, use_gather_object=False):
    """Accelerate's, over the dp ranks (tensors through the patched ``accelerator.gather``; other objects here),
    dropping the duplicated tail of the last batch as Accelerate does."""
    from accelerate.utils import recursively_apply

    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        all_tensors = True
    except TypeError:
        all_tensors = False
    if (all_tensors and not use_gather_object) or dp_group is None:
        return original(input_data, use_gather_object=use_gather_object)
    objects = input_data if isinstance(input_data, list) else [input_data]
    data = gather_objects_over(objects, dp_group)
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        return data[: state.remainder]
    return data
