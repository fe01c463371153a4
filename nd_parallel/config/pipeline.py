"""Pipeline parallelism's options: the schedule, micro-batches, stages per rank, engine, layer balance, timeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import ConfigError, ConfigTypeError, _check_choice, _check_count, _is_int, _kind
from .layout import Layout

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
PP_BACKENDS = ("torch", "deepspeed")
PP_BALANCE_NAMES = ("uniform", "profile")
# What the neutral value of each count means; quoted as the fix in error messages.
_NEUTRAL = {
    "pp_virtual_stages": "pp_virtual_stages=1 for one pipeline stage per rank",
    "pp_microbatches": "pp_microbatches=None for one micro-batch per pipeline stage",
    "pp_timeline_step": "pp_timeline_step=3 (the third step)",
}


# A Layout because the checks read the sizes: pp_size for the balance, the others for the deepspeed engine's limits.
@dataclass(kw_only=True)
class PipelineOptions(Layout):
    """How the pipeline runs: schedule, micro-batches, stages per rank, engine, layers per stage, timeline."""

    pp_schedule: str = "1f1b"
    """Pipeline schedule: "1f1b" (default), "gpipe", "interleaved-1f1b", "interleaved-zb", "zbv"."""
    pp_microbatches: int | None = None
    """Micro-batches per step under PP. Default None (= pp_size); otherwise >= 1."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank. Default 1; >= 2 for interleaved schedules, exactly 2 for "zbv"."""
    pp_backend: str = "torch"
    """Pipeline engine. Default "torch" (torch.distributed.pipelining); or "deepspeed"."""
    pp_balance: str | list[int] = "uniform"
    """Layers per stage: "uniform" (default), "profile", or a list of pp_size*pp_virtual_stages."""
    pp_profile_shape: tuple[int, int] | None = None
    """(micro-batch size, sequence length) pp_balance="profile" measures. Default None = (1, min(max positions, 512))."""
    pp_timeline: str | None = None
    """Directory for one step's pipeline timeline (timeline.json for Perfetto, timeline.png). Default None = off."""
    pp_timeline_step: int = 3
    """The step (1-based) that pp_timeline records; the first ones pay for start-up. Default 3; >= 1."""

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: pp_microbatches, or pp_size when that is None."""
        return self.pp_microbatches if self.pp_microbatches is not None else self.pp_size

    def _check_pipeline_counts(self) -> None:
        """The counts, the profile shape and the timeline path, each on its own."""
        if self.pp_microbatches is not None:
            self.pp_microbatches = _check_count("pp_microbatches", self.pp_microbatches, _NEUTRAL["pp_microbatches"])
        self.pp_virtual_stages = _check_count("pp_virtual_stages", self.pp_virtual_stages,
                                              _NEUTRAL["pp_virtual_stages"])
        self.pp_timeline_step = _check_count("pp_timeline_step", self.pp_timeline_step, _NEUTRAL["pp_timeline_step"])
        self.pp_profile_shape = _check_shape(self.pp_profile_shape)
        if self.pp_timeline is not None and not isinstance(self.pp_timeline, str):
            raise ConfigTypeError(f"pp_timeline={self.pp_timeline!r} is {_kind(self.pp_timeline)}; give a directory "
                                  "path such as pp_timeline='runs/timeline', or None")

    def _check_pipeline_choices(self) -> None:
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _check_choice("pp_backend", self.pp_backend, PP_BACKENDS)

    def _check_pipeline(self) -> None:
        """How the options fit each other and the layout; runs last, once every other value has passed its own check."""
        self._check_schedule_stages()
        self._check_deepspeed()
        self.pp_balance = _check_balance(self.pp_balance, self.pp_size, self.pp_virtual_stages)

    def _check_schedule_stages(self) -> None:
        schedule, stages = self.pp_schedule, self.pp_virtual_stages
        if schedule == "zbv" and stages != 2:
            raise ConfigError(f"pp_schedule='zbv' places exactly 2 stages per rank, but pp_virtual_"
                              f"stages={stages}; set pp_virtual_stages=2, or use 'interleaved-zb'")
        if schedule.startswith("interleaved") and stages < 2:
            raise ConfigError(f"pp_schedule={schedule!r} needs pp_virtual_stages >= 2 (several "
                              f"stages per rank), got pp_virtual_stages={stages}; set "
                              "pp_virtual_stages=2, or use pp_schedule='1f1b'")
        if schedule in ("gpipe", "1f1b") and stages > 1:
            raise ConfigError(f"pp_schedule={schedule!r} runs one stage per rank, but pp_virtual_"
                              f"stages={stages}; use pp_schedule='interleaved-1f1b' for {stages} "
                              "stages per rank, or pp_virtual_stages=1")

    def _check_deepspeed(self) -> None:
        if self.pp_backend != "deepspeed":
            return
        clashes = [f"{n}={getattr(self, n)}" for n in ("dp_shard_size", "tp_size", "cp_size")
                   if getattr(self, n) > 1]  # dp_shard_size=-1 is checked again after resolve()
        if clashes:
            raise ConfigError(
                f"pp_backend='deepspeed' cannot be combined with {', '.join(clashes)}: DeepSpeed's "
                "pipeline engine supports data parallelism with ZeRO stage <= 1 only; use "
                "dp_replicate_size for data parallelism, or pp_backend='torch' to combine the "
                "pipeline with sharding, tensor or context parallelism")
        if self.pp_schedule != "1f1b":
            raise ConfigError(f"pp_backend='deepspeed' runs its own 1F1B-style schedule, so "
                              f"pp_schedule={self.pp_schedule!r} cannot apply; use "
                              "pp_schedule='1f1b', or pp_backend='torch' for other schedules")


def _check_shape(shape: Any) -> tuple[int, int] | None:
    """None, or (micro-batch size, sequence length) as two positive integers."""
    if shape is None:
        return None
    if not isinstance(shape, (list, tuple)) or len(shape) != 2 or not all(_is_int(v) and v >= 1 for v in shape):
        raise ConfigError(f"pp_profile_shape={shape!r} must be two positive integers (micro-batch size, sequence "
                          "length), for example pp_profile_shape=(1, 512)")
    return (int(shape[0]), int(shape[1]))


def _check_balance(balance: Any, pp_size: int, virtual: int) -> str | list[int]:
    if isinstance(balance, str):
        _check_choice("pp_balance", balance, PP_BALANCE_NAMES)
        return balance
    if not isinstance(balance, (list, tuple)):
        raise ConfigTypeError(f"pp_balance={balance!r} is {_kind(balance)}; use 'uniform', "
                              "'profile', or a list of layers per stage such as [4, 4]")
    for i, layers in enumerate(balance):
        if not _is_int(layers):
            raise ConfigTypeError(f"pp_balance[{i}]={layers!r} is {_kind(layers)}; entries are "
                                  "layer counts (integers), e.g. pp_balance=[4, 4]")
        if layers < 1:
            raise ConfigError(f"pp_balance[{i}]={layers} must be a positive number of layers; "
                              "every stage needs at least one layer")
    if len(balance) != pp_size * virtual:
        raise ConfigError(
            f"pp_balance={list(balance)} has {len(balance)} entries, but pp_size({pp_size}) * "
            f"pp_virtual_stages({virtual}) = {pp_size * virtual} stages; give one layer count "
            "per stage, or use pp_balance='uniform'")
    return [int(x) for x in balance]
