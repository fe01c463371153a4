"""Checkpoint options: how save_state writes a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import _check_bool


@dataclass(kw_only=True)
class CheckpointOptions:
    """How a checkpoint is written."""

    async_save: bool = False
    """save_state returns once the state is copied; torch.distributed.checkpoint writes it in the background and
    the checkpoint is published when every rank's files are written. Default False."""

    def _check_checkpoint(self) -> None:
        _check_bool("async_save", self.async_save)
