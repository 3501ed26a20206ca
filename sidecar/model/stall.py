"""The snapshot a stall leaves: taken by the stalls wing (``stalls/tracker.py``) on its own
thread when a job has made no progress for ``--stall-after`` seconds, shown by ``/ranks`` while
it lasts and put in the postmortem of a death it preceded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = ["StallSnapshot", "StalledRank"]


@dataclass(frozen=True, slots=True)
class StalledRank:
    """One rank at the stall: its activity, and its Python stack or why there is none."""

    rank: int | None
    label: str
    pid: int
    stalled_seconds: float | None
    reason: str | None  # idle, collective, waiting (stalls/tracker.py)
    cpu_busy: bool | None
    gpu_busy: bool | None
    gpu_sm_percent: float | None
    gpu_memory_percent: float | None
    stack: str | None
    stack_error: str | None
    in_collective: bool | None  # its stack is inside torch.distributed


@dataclass(frozen=True, slots=True)
class StallSnapshot:
    """Who is suspected of holding the job up, and by what (``suspected_by``: activity,
    stacks or the flight recorder, the strongest last); ``ended_at`` once the job moved
    again (wall times, seconds)."""

    detected_at: float
    stalled_seconds: float
    ranks: tuple[StalledRank, ...]
    suspected_missing: tuple[str, ...]
    suspected_by: str | None
    flight_recorder: str | None
    ended_at: float | None = None

    def ended(self, at: float) -> StallSnapshot:
        return replace(self, ended_at=at)

    def view(self, dated: Callable[[float | None], Any] = lambda at: at) -> dict[str, Any]:
        """As JSON shows it (``/ranks``, the postmortem's ``stall``), its two times given by
        ``dated`` (the postmortem writes ISO 8601, ``/ranks`` seconds)."""
        return {
            "detected_at": dated(self.detected_at),
            "stalled_seconds": self.stalled_seconds,
            "ranks": [asdict(r) for r in self.ranks],
            "suspected_missing": list(self.suspected_missing),
            "suspected_by": self.suspected_by,
            "flight_recorder": self.flight_recorder,
            "ended_at": dated(self.ended_at),
        }
