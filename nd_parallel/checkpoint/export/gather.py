"""The collective half of an online export: which ranks hold which tensor, and each tensor made whole in turn.

Every rank must walk the same order (``entries``) and iterate ``gather_one_by_one`` to the end: a sharded tensor
is made whole over its own mesh, and a pipeline stage without the main process sends its tensors from its first
rank, so the collectives of each stage and the send/receive pairs line up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..names import named_state
from .writer import Entry, natural_key


def where(who) -> tuple[bool, bool, torch.device]:
    """(main process, several processes, device) of anything that says so: a TrainState or an Accelerator."""
    distributed = dist.is_initialized() and who.num_processes > 1
    return who.is_main_process, distributed, who.device


def entries(local: dict, distributed: bool) -> tuple[list[Entry], dict[str, list[int]]]:
    """Every rank's tensors (name, global shape, dtype) in one order, and which ranks hold each."""
    mine = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in local.items()
            if isinstance(v, torch.Tensor)]
    everyone = [mine]
    if distributed:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    holders: dict[str, list[int]] = {}
    entries: dict[str, Entry] = {}
    for rank, items in enumerate(everyone):
        for name, shape, dtype in items:
            holders.setdefault(name, []).append(rank)
            entries[name] = Entry(name, shape, getattr(torch, dtype))
    return [entries[n] for n in sorted(entries, key=natural_key)], holders


def gather_one_by_one(who, local: dict, order: list[Entry], holders: dict[str, list[int]]):
    """Yield (name, full tensor) on the main process, one at a time; every rank must iterate it to the end.

    A sharded tensor is made whole over its own mesh (the ranks of its pipeline stage); a stage without the
    main process sends it from its first rank. Every rank walks the same order, so the collectives of each
    stage and the send/receive pairs line up.
    """
    main, distributed, device = where(who)
    me = dist.get_rank() if distributed else 0
    for e in order:
        tensor = None
        if e.name in local:
            value = local[e.name]
            tensor = value.full_tensor() if hasattr(value, "full_tensor") else value  # collective over its mesh
        lead = holders[e.name][0]
        if main and tensor is None:
            tensor = torch.empty(e.shape, dtype=e.dtype, device=device)
            dist.recv(tensor, src=lead)
        elif not main and me == lead and 0 not in holders[e.name]:
            dist.send(tensor.contiguous(), dst=0)
        if main:
            yield e.name, tensor
        del tensor


def full_state(who, model, optimizer=None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's canonical state (``model.<HF name>``, ``optim.state.<HF name>.exp_avg``,
    ...) made whole, on the CPU of the main process (empty elsewhere). A collective: every rank calls it.
    ``who``: the TrainState or Accelerator of the run."""
    named = named_state(model, optimizer)
    order, holders = entries(named.flat, where(who)[1])
    return {k: v.detach().cpu().clone() for k, v in gather_one_by_one(who, named.flat, order, holders)}


