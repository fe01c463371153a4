"""Where a prepared dataloader stands, saved with the checkpoint and restored by ``load_state``.

How the position is restored (the contract): ``accelerator.load_state`` puts every prepared dataloader back
where it was when ``save_state`` ran, the way Accelerate does for ``use_stateful_dataloader=True``. The next
``for batch in dataloader`` continues with the first batch the saved run had not handed out yet, in the same
epoch and the same (shuffled) order; later epochs run in full. Do not call ``accelerator.skip_first_batches``
as well: that would skip the same batches twice, so under the plugin it refuses while a restored position is
pending.

The position counts the batches the loop *received* in the current epoch (a batch fetched and then left
unused by a ``break`` counts). The order is reproduced by restoring, for the resumed epoch only, the state of
the sampler's generator and of torch's global RNG at the start of that epoch (what drew the permutation), then
putting the global RNG back to its state at save time. Skipped batches are read and dropped (the dataset
is not indexed around them), which costs reading them once. Random transforms in the dataset are not
replayed bit for bit.

With another number of data-parallel ranks the position is converted through the number of samples consumed
(``batches x samples per step``) and a warning says so; samples that cannot be split evenly are seen again
rather than skipped.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


class CheckpointWarning(UserWarning):
    """Something about a resumed run that differs from the saved one (the numbers are in the message)."""


@dataclass
class Position:
    epoch: int = 0
    batches: int = 0  # batches handed to the loop in this epoch
    torch_rng: torch.Tensor | None = None  # torch's global RNG when this epoch's iterator was created
    generator: torch.Tensor | None = None  # the sampler's generator then
    pending: "Position | None" = None  # set by load_state: where the next iteration starts


def _generator(loader) -> torch.Generator | None:
    gen = getattr(loader, "synchronized_generator", None)
    if gen is None:
        from accelerate.data_loader import get_sampler

        gen = getattr(get_sampler(loader), "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


class _Tracked:
    """Mixed into the class of a prepared loader: counts what it hands out and resumes a restored position."""

    def __iter__(self):
        pos: Position = self._nd_position
        resume, pos.pending = pos.pending, None
        at_save = None
        if resume is not None:
            at_save = torch.get_rng_state()  # load_state restored it; the epoch's start state draws the order
            if resume.torch_rng is not None:
                torch.set_rng_state(resume.torch_rng)
            gen = _generator(self)
            if gen is not None and resume.generator is not None:
                gen.set_state(resume.generator)
            self.iteration = resume.epoch
            skip_before = self.skip_batches
            self.skip_batches = skip_before + resume.batches
        gen = _generator(self)
        pos.epoch, pos.batches = self.iteration, resume.batches if resume is not None else 0
        pos.torch_rng, pos.generator = torch.get_rng_state(), gen.get_state() if gen is not None else None
        inner = super().__iter__()
        try:
            while True:
                try:
                    batch = next(inner)
                except StopIteration:
                    break
                finally:
                    if at_save is not None:  # the iterator exists and has drawn its order: back to the saved RNG
                        torch.set_rng_state(at_save)
                        at_save = None
                pos.batches += 1
                yield batch
        finally:
            if resume is not None:
                self.skip_batches = skip_before
            if at_save is not None:
                torch.set_rng_state(at_save)
        pos.epoch, pos.batches = self.iteration, 0  # the epoch ran out: the next one starts at batch 0


_CLASSES: dict[type, type] = {}


def track(loader):
    """Make a prepared loader keep its position. Accelerate's loaders report their base class through a
    ``__class__`` property, so the class is set through ``object``'s own descriptor."""
    if hasattr(loader, "_nd_position"):
        return loader
    cls = type(loader)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_Tracked, cls), {"__module__": __name__})
    object.__dict__["__class__"].__set__(loader, _CLASSES[cls])
    loader._nd_position = Position(epoch=getattr(loader, "iteration", 0))
    return loader


def position(loader) -> Position | None:
    return getattr(loader, "_nd_position", None)


def has_pending(loader) -> bool:
    pos = position(loader)
    return pos is not None and pos.pending is not None


def samples_per_step(loader) -> int | None:
    """Samples one step of the loop takes over all data-parallel ranks (None when the loader cannot say)."""
    from accelerate.data_loader import IterableDatasetShard

    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        return dataset.batch_size * (1 if dataset.split_batches else dataset.num_processes)
    try:
        return int(loader.total_batch_size)
    except (AttributeError, TypeError):
        return None


def describe(loader, dp_size: int) -> dict:
    pos = position(loader) or Position(epoch=getattr(loader, "iteration", 0))
    return {"epoch": pos.epoch, "batches": pos.batches, "dp_size": dp_size,
            "samples_per_step": samples_per_step(loader)}


def resume_at(saved: dict, loader, dp_size: int, index: int) -> int:
    """Per-rank batches to skip in the saved epoch, converted when the data-parallel degree changed (warns)."""
    batches = int(saved["batches"])
    old_dp, old_step, new_step = saved.get("dp_size"), saved.get("samples_per_step"), samples_per_step(loader)
    if old_dp == dp_size and old_step == new_step:
        return batches
    if not old_step or not new_step:
        warnings.warn(f"dataloader {index}: saved with {old_dp} data-parallel ranks, loaded with {dp_size}; its "
                      f"samples per step are unknown, so it resumes at batch {batches} of epoch {saved['epoch']} "
                      "per rank: check that no data is skipped or repeated", CheckpointWarning, stacklevel=3)
        return batches
    consumed = batches * old_step
    new_batches, repeated = divmod(consumed, new_step)
    note = ("exactly where the saved run stopped" if not repeated else
            f"{repeated} samples already seen are seen again (never skipped)")
    warnings.warn(
        f"dataloader {index}: the checkpoint was saved with {old_dp} data-parallel ranks ({old_step} samples per "
        f"step) after {batches} batches of epoch {saved['epoch']} = {consumed} samples; with {dp_size} "
        f"data-parallel ranks ({new_step} samples per step) this run resumes at batch {new_batches} of that epoch "
        f"on every rank: {note}. The samples per step changed, so adjust the learning rate / step count if "
        "needed", CheckpointWarning, stacklevel=3)
    return new_batches


def restore(loader, saved: dict, batches: int, torch_rng, generator) -> None:
    """Arm the loader so that its next iteration starts at ``batches`` of the saved epoch."""
    track(loader)
    loader.iteration = int(saved["epoch"])
    loader._nd_position.pending = Position(epoch=int(saved["epoch"]), batches=batches, torch_rng=torch_rng,
                                           generator=generator)
