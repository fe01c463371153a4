"""The record of one recorded action (F, B or W of one micro-batch on one stage).

In a module of its own because recording, analysis and rendering all use it, and none of them should have
to import another just for the type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Event:
    rank: int  # rank in the pp group
    stage: int  # global stage index
    mb: int  # micro-batch index
    kind: str  # "F", "B" or "W"
    start: float  # seconds
    end: float

    @property
    def name(self) -> str:
        return f"{self.kind}{self.mb}"


def to_dicts(events: list[Event]) -> list[dict]:
    return [asdict(e) for e in events]
