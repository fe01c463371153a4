"""Schedule names -> torch.distributed.pipelining classes, and what each one needs (checked up front)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import pipelining as pp


@dataclass(frozen=True)
class ScheduleInfo:
    cls: type
    multi_stage: bool  # takes a list of stages (virtual stages per rank)
    placement: str  # "loop": rank r runs stages r, r+p, ...; "v": stages r and 2p-1-r
    min_microbatches: str  # "any" or "stages": needs n_microbatches >= pp_size


SCHEDULES = {
    "gpipe": ScheduleInfo(pp.ScheduleGPipe, False, "loop", "any"),
    "1f1b": ScheduleInfo(pp.Schedule1F1B, False, "loop", "stages"),
    "interleaved-1f1b": ScheduleInfo(pp.ScheduleInterleaved1F1B, True, "loop", "stages"),
    "interleaved-zb": ScheduleInfo(pp.ScheduleInterleavedZeroBubble, True, "loop", "stages"),
    "zbv": ScheduleInfo(pp.ScheduleZBVZeroBubble, True, "v", "stages"),
}


def check_microbatches(schedule: str, pp_size: int, microbatches: int, local_batch: int | None = None) -> None:
    """Refuse micro-batch counts a schedule cannot run, and batches they don't divide."""
    info = SCHEDULES[schedule]
    if info.min_microbatches == "stages" and microbatches < pp_size:
        raise ValueError(
            f"pp_schedule='{schedule}' needs pp_microbatches >= pp_size, got pp_microbatches={microbatches} with "
            f"pp_size={pp_size}; use pp_microbatches={pp_size} or more (or pp_schedule='gpipe')"
        )
    if local_batch is not None and local_batch % microbatches:
        raise ValueError(
            f"the batch of {local_batch} samples per data-parallel rank cannot be split into "
            f"pp_microbatches={microbatches}; use a per-rank batch size that is a multiple of {microbatches}"
        )
