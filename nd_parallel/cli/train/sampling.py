"""Axolotl's ``group_by_length: true``: the Trainer's length-grouped sampler (transformers' LengthGroupedSampler
order: a random permutation cut into megabatches of up to 50 batches, each sorted by length, longest first, so a
batch holds samples of similar length and pads less), what Axolotl turns on through ``train_sampling_strategy``.

One difference so that a layout trains as one process does: the megabatches are made of *global* batches (micro-batch
x data-parallel ranks x gradient accumulation) and the permutation comes from a generator seeded with the run's seed
and the epoch, not torch's global one. transformers sizes them by the per-device batch, so under dp ranks the grouping
(and so which samples meet in a step) would change with the number of ranks; here one process on the global batch and
every layout take the same samples in the same steps. As in Axolotl, packed rows (``sample_packing``) and
``curriculum_sampling`` keep their own order, and the RL, reward-model and multimodal trainers are not grouped: the
key changes nothing there (one line says so). Evaluation is not reordered. A streamed dataset has no lengths up front:
refused, as Axolotl refuses it with ``pretraining_dataset``.
"""

from __future__ import annotations

import torch


class _EpochSeeded(torch.utils.data.Sampler):
    """LengthGroupedSampler's order for each epoch from a generator seeded by (seed, epoch): the same on every rank,
    and again after a resume (the Trainer sets the epoch through the prepared dataloader)."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        self.batch_size, self.lengths, self.seed, self.epoch = batch_size, lengths, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        from transformers.trainer_pt_utils import get_length_grouped_indices

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


# keys whose runs keep their own order (packing, curriculum) or trainer (RL, reward models, multimodal): not grouped
NOT_GROUPED = ("sample_packing", "curriculum_sampling", "rl", "reward_model", "process_reward_model", "processor_type")


def note(d: dict) -> list[str]:
    if not d.get("group_by_length"):
        return []
    other = next((k for k in NOT_GROUPED if d.get(k)), None)
    if other:
        return [f"group_by_length with {other}: not grouped ({other} keeps its own order, as in Axolotl)"]
    return ["group_by_length: megabatches of 50 global batches sorted by length, seeded by seed and epoch, so every "
            "layout groups as one process does (transformers sizes them by the per-device batch)"]


def refusals(d: dict) -> list[str]:
    if d.get("group_by_length") and (d.get("streaming") or d.get("pretraining_dataset")):
        return ["group_by_length with a streamed dataset: its lengths are not known before training (Axolotl refuses "
                "it with pretraining_dataset too); drop group_by_length"]
    return []


def use_length_groups(trainer, t, dp: int) -> None:
    """Axolotl's group_by_length on ``trainer``'s training data (see the module docstring)."""
    if not t.group_by_length or any(getattr(t, key) for key in NOT_GROUPED):  # note() names the case
        return
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    batch = t.micro_batch_size * dp * t.gradient_accumulation_steps
    trainer._get_train_sampler = lambda *_: _EpochSeeded(batch, lengths, t.seed)  # the Trainer's sampler hook
