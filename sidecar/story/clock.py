"""Each node's clock against Prometheus's, bounded from the scrapes themselves.

Prometheus stamps every sample of a scrape with the time the scrape started, on its own
clock (``t``), moved by at most its timestamp tolerance ``e`` to align it with the scrape
interval (``--scrape.timestamp-tolerance``, 2 ms by default, read from its flags), and
records how long the scrape took (``scrape_duration_seconds``, ``D``). The daemon writes
its own clock into the answer (``trainwatch_time_seconds``, ``v``) while it answers. ``D``
is timed from a second reading of Prometheus's clock, taken when the scrape goroutine runs
(scrape.go: the loop reads ``scrapeTime``, ``scrapeAndReport`` then reads ``start``): on a
loaded machine the goroutine may wait ``s`` between the two, so
``t - e <= v - offset <= t + s + D + e``: each scrape bounds the node's offset to
``[v - t - D - e - s, v - t + e]``, and every scrape near the deaths narrows it further.
``s`` is not recorded anywhere; ``SCHEDULING_S`` allows for it (a loaded 2-core CI machine
showed 70 us past the other bounds). A daemon
without that gauge is bounded by its last sampling round instead
(``trainwatch_last_sample_timestamp_seconds``: finished before the answer, at most one
round's gap before it), which is wider by a sampling interval.

An offset is ``node clock - Prometheus clock``; a node time ``x`` is ``x - offset`` on
Prometheus's clock, within the offset's width.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["SCHEDULING_S", "Offset", "from_rounds", "from_stamps"]

# what a scrape that Prometheus kept no duration for may have lasted (its default timeout)
DEFAULT_SCRAPE_SECONDS = 10.0
# the wait of Prometheus's scrape goroutine between its timestamp and the start of the
# scrape's duration, unrecorded: allowed for in the lower bound (see the module's text)
SCHEDULING_S = 0.005


@dataclass(frozen=True, slots=True)
class Offset:
    """``low <= node clock - Prometheus clock <= high``; both None when nothing bounds it."""

    low: float | None
    high: float | None
    samples: int
    source: str  # the series it came from, or "none"
    stepped: bool = False  # the bounds of different scrapes disagree: the node's clock moved

    @property
    def known(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def middle(self) -> float:
        return 0.0 if self.low is None or self.high is None else (self.low + self.high) / 2

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2

    def as_dict(self) -> dict[str, object]:
        return {
            "offset_seconds": None if not self.known else {"low": _r(self.low), "high": _r(self.high)},
            "samples": self.samples,
            "source": self.source,
            "stepped": self.stepped,
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


# Unix times near 1.8e9 s carry about 0.24 us of float64 precision: each bound gets a
# microsecond either way, so exact scrapes do not look like a clock that moved
_EPS = 1e-6


def _intersect(bounds: Sequence[tuple[float, float]], source: str) -> Offset:
    if not bounds:
        return Offset(None, None, 0, "none")
    bounds = [(lo - _EPS, hi + _EPS) for lo, hi in bounds]
    low = max(b[0] for b in bounds)
    high = min(b[1] for b in bounds)
    if low <= high:
        return Offset(low, high, len(bounds), source)
    # the scrapes disagree (the node's clock was stepped or slewed fast between them): say
    # so, and keep the whole range they span rather than a false precise one
    return Offset(min(b[0] for b in bounds), max(b[1] for b in bounds), len(bounds), source, stepped=True)


def from_stamps(
    stamps: Iterable[tuple[float, float]],
    durations: dict[float, float],
    tolerance: float = 0.002,
    source: str = "trainwatch_time_seconds",
) -> Offset:
    """``stamps``: (Prometheus's scrape time, the daemon's clock in that answer);
    ``durations``: scrape time -> that scrape's duration; ``tolerance``: how far
    Prometheus moves a scrape's timestamp from its real start to align it (either way)."""
    bounds = []
    fallback = max(durations.values(), default=DEFAULT_SCRAPE_SECONDS)
    for t, v in stamps:
        d = durations.get(t, fallback)
        bounds.append((v - t - d - tolerance - SCHEDULING_S, v - t + tolerance))
    return _intersect(bounds, source)


def from_rounds(
    rounds: Iterable[tuple[float, float]],
    durations: dict[float, float],
    tolerance: float = 0.002,
    source: str = "trainwatch_last_sample_timestamp_seconds",
) -> Offset:
    """``rounds``: (Prometheus's scrape time, the node time its last sampling round
    finished). The round finished before the answer and at most the longest gap between
    two rounds before it."""
    pairs = sorted(rounds)
    finished = sorted({v for _, v in pairs})
    gap = max((b - a for a, b in itertools.pairwise(finished)), default=None)
    if gap is None:
        return Offset(None, None, 0, "none")
    fallback = max(durations.values(), default=DEFAULT_SCRAPE_SECONDS)
    bounds = [
        (v - t - durations.get(t, fallback) - tolerance - SCHEDULING_S, v - t + gap + tolerance)
        for t, v in pairs
    ]
    return _intersect(bounds, source)
