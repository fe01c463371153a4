"""Dataloader sharding over the data-parallel ranks only (tp/cp/pp peers see the same samples)."""

from __future__ import annotations

from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from nd_parallel.config import ParallelismConfig


def dp_coordinates(config: ParallelismConfig, rank: int) -> tuple[int, int]:
    """(dp_rank, dp_size) of a global rank, computed from the mesh order without any collective.

    The mesh is (pp, dp_replicate, dp_shard, cp, tp) in row-major order, so the flattened dp index is the
    rank divided by the size of the dims inside it, modulo the dp size.
    """
    inner = config.cp_size * config.tp_size
    dp_size = config.dp_replicate_size * config.dp_shard_size
    return (rank // inner) % dp_size, dp_size


def check_batch_size(dataloader: DataLoader, config: ParallelismConfig, split_batches: bool) -> None:
    """Refuse, before any collective, a batch size the layout cannot split evenly."""
    batch_size = getattr(dataloader, "batch_size", None)
    if batch_size is None and getattr(dataloader, "batch_sampler", None) is not None:
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
    dp = config.dp_replicate_size * config.dp_shard_size
    per_rank = batch_size // dp if (split_batches and batch_size is not None) else batch_size
    if config.pp_size > 1 and per_rank is not None and per_rank % config.microbatches:
        raise ValueError(
            f"the batch of {per_rank} samples per data-parallel rank cannot be split into "
            f"pp_microbatches={config.microbatches}; use a per-rank batch size that is a multiple of "
            f"{config.microbatches} (or fewer micro-batches)"
        )
    if split_batches and batch_size is not None and batch_size % dp:
        raise ValueError(
            f"batch_size={batch_size} cannot be split over {dp} data-parallel ranks "
            f"(dp_replicate_size={config.dp_replicate_size} x dp_shard_size={config.dp_shard_size}) with "
            f"split_batches=True; use a batch size that is a multiple of {dp}"
        )


def shard_dataloader(dataloader: DataLoader, config: ParallelismConfig, rank: int, accelerator) -> DataLoader:
    """Accelerate's own dataloader sharding, told that only the dp ranks are distinct processes."""
    dp_rank, dp_size = dp_coordinates(config, rank)
    return prepare_data_loader(
        dataloader,
        accelerator.device,
        num_processes=dp_size,
        process_index=dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
