"""Foresight: see an OOM coming.

For every limit that can kill a rank (a memory cgroup's limit, or the host's memory for a
global OOM) and for every rank, a robust trend of the memory reclaim cannot take back
(anon + shmem, and a cgroup's kernel memory: never page cache, which a limit reclaims
before it kills). While a rank's own unreclaimable memory grows and the charge of the limit
that binds it grows too, the predicted seconds until that limit is reached are
``headroom / rate``. They go on the snapshot (``RankSample.exhaustion_seconds``,
``CgroupSample.exhaustion_seconds``), from there to the metrics and ``/ranks``; the first
prediction of an episode under ``WARN_SECONDS`` is logged as a WARNING and kept for the
postmortem's ``warnings``, and so is a later one of the same episode that is news (``_news``:
the limit at least twice and 10 s sooner, or a new trend after the last warning's time passed).

The trend is a mechanism, not a curve fit to one job: over the longest of a few windows
(45, 15, 5 s) whose two halves *both* grow at comparable rates (Theil-Sen slope of each
half, so an outlier moves nothing), with the rise over the window well above the noise
around the line, and for at least ``CONFIRM_SECONDS`` in a row. So a step (a checkpoint
loaded at once) never makes both halves grow and passes within a window; a steady job's
noise is neither consistent nor significant; a leak is both. The rate used is that of
the window's recent half: an accelerating leak is followed, a leak that started after a
flat stretch is seen in the shortest window that holds only the leak.

Cost: a series keeps at most one point per ``SPACING_SECONDS`` for 45 s; a window is
thinned to ``POINTS_PER_WINDOW`` points, so one evaluation is a few hundred slopes, and
most stop at the first window whose halves do not both grow. A rank's trend is judged
only while the charge of the limit that binds it grows: a steady job judges one series
per limit a second, not one per rank.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar import lognames
from sidecar.model import CgroupSample, MemoryLimit, ProcKey, RankSample, Snapshot, Warned, evolve
from sidecar.trend import median, theil_sen
from sidecar.units import gib_or_mib

__all__ = [
    "CONFIRM_SECONDS",
    "WARN_SECONDS",
    "Foresight",
    "Series",
    "growth_rate",
]

log = logging.getLogger(lognames.FORESIGHT)

WINDOWS_SECONDS = (45.0, 15.0, 5.0)  # longest first: the longest consistent one is used
SPACING_SECONDS = 0.25  # a series keeps at most one point this often (the sampler runs at 10 Hz near a limit)
POINTS_PER_WINDOW = 24
MIN_POINTS_PER_HALF = 3
COVERAGE = 0.8  # a window counts once the series reaches this far back into it
SLACK = 0.05  # rounds are not exactly one interval apart: a window takes points this much older too
CONSISTENCY = 1 / 3  # the slower half grows at least this fraction of the faster one
SIGNIFICANCE = 4.0  # the rise over the window, in robust standard deviations of the residuals
NOISE_FLOOR_BYTES = 64 * 1024  # a perfectly straight series still has page-sized jitter
MIN_RATE_BYTES_PER_SECOND = 256 * 1024  # slower than this is nothing a run will die of soon
CONFIRM_SECONDS = 3.0  # growth must hold this long before anything is said
MAX_SECONDS = 86_400.0  # beyond a day, a prediction is not one
WARN_SECONDS = 600.0  # a WARNING when the limit is closer than this (an episode's first, then news only)
EPISODE_GAP_SECONDS = 30.0  # an episode ends after this long without a prediction
# Within an episode a forecast is warned about again only when it is news: the limit comes at
# least SOONER_FACTOR times sooner than the last warning left (and SOONER_SECONDS sooner), or
# the trend was lost and found again after that warning's time passed by SOONER_SECONDS.
SOONER_FACTOR = 2.0
SOONER_SECONDS = 10.0
WARNINGS_PER_JOB = 16


def _thin(points: list[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    if len(points) <= most:
        return points
    step = (len(points) - 1) / (most - 1)
    return [points[round(i * step)] for i in range(most)]


def growth_rate(points: Sequence[tuple[float, float]], now: float) -> float | None:
    """The rate (bytes/s) at which a series consistently grows at ``now``, or None.

    ``points`` are (monotonic seconds, bytes), oldest first."""
    if len(points) < 2 * MIN_POINTS_PER_HALF:
        return None
    first = points[0][0]
    for window in WINDOWS_SECONDS:
        start = now - window * (1 + SLACK)
        if first > now - COVERAGE * window:
            continue  # the series does not reach back into this window yet
        inside = _thin([p for p in points if p[0] >= start], POINTS_PER_WINDOW)
        mid = now - window / 2
        older = [p for p in inside if p[0] < mid]
        newer = [p for p in inside if p[0] >= mid]
        if len(older) < MIN_POINTS_PER_HALF or len(newer) < MIN_POINTS_PER_HALF:
            continue
        s_old, s_new = theil_sen(older), theil_sen(newer)
        if s_old <= 0 or s_new <= 0 or min(s_old, s_new) < CONSISTENCY * max(s_old, s_new):
            continue
        slope = theil_sen(inside)
        if slope < MIN_RATE_BYTES_PER_SECOND or s_new < MIN_RATE_BYTES_PER_SECOND:
            continue
        # still growing at the end: a leak that stopped is let go within a quarter window
        latest = [p for p in inside if p[0] >= now - window / 4]
        if len(latest) >= MIN_POINTS_PER_HALF and theil_sen(latest) < CONSISTENCY * s_new:
            continue
        t0 = inside[0][0]
        intercept = median([v - slope * (t - t0) for t, v in inside])
        residuals = [abs(v - intercept - slope * (t - t0)) for t, v in inside]
        noise = max(1.4826 * median(residuals), NOISE_FLOOR_BYTES)
        if slope * (inside[-1][0] - t0) < SIGNIFICANCE * noise:
            continue
        return s_new
    return None


class Series:
    """One quantity's recent history, thinned, and whether it has been growing long
    enough to be believed."""

    __slots__ = ("_points", "growing_since", "rate")

    def __init__(self) -> None:
        self._points: deque[tuple[float, float]] = deque()
        self.growing_since: float | None = None
        self.rate: float | None = None  # bytes/s while growth is confirmed, else None

    def add(self, t: float, value: float, judge: bool = True) -> None:
        """Record a value; re-evaluates the trend when the point is kept and ``judge``
        (else the series counts as not growing until it is judged again)."""
        points = self._points
        if points and t - points[-1][0] < SPACING_SECONDS:
            return
        points.append((t, value))
        horizon = t - WINDOWS_SECONDS[0] - 1.0
        while points and points[0][0] < horizon:
            points.popleft()
        rate = growth_rate(points, t) if judge else None
        if rate is None:
            self.growing_since = None
            self.rate = None
            return
        if self.growing_since is None:
            self.growing_since = t
        self.rate = rate if t - self.growing_since >= CONFIRM_SECONDS else None


@dataclass(slots=True)
class _Episode:
    last_seen: float
    deadline: float | None = None  # when the last warning put the limit (monotonic); None: none yet
    lapsed: bool = False  # a round without a forecast since the last warning: the trend was lost


def _news(episode: _Episode, seconds: float, t: float) -> str | None:
    """Whether a forecast of ``seconds`` left at ``t`` is news in this episode: None if not,
    else what the log line adds ("" for the episode's first warning). A leak's forecasts
    agree with each other and are warned once; a growth that slows (a cache filling up) only
    puts the limit later and is warned once too; a growth that stopped short of the limit (a
    job's start, a model loaded) and then a leak that will reach it are two warnings: the
    leak's forecast is much sooner, or comes after the trend was lost and the last warning's
    time has passed."""
    if episode.deadline is None:
        return ""
    left = episode.deadline - t
    if left <= -SOONER_SECONDS and episode.lapsed:
        return f" (a new trend: the last warning put it {-left:.0f} s ago)"
    if seconds * SOONER_FACTOR <= left and left - seconds >= SOONER_SECONDS:
        return f" ({left - seconds:.0f} s sooner than the last warning put it)"
    return None


def _committed(cg: CgroupSample) -> int | None:
    """What of a cgroup's charge reclaim cannot take back: the usage less its page cache
    (anon, shmem and kernel memory). The usage counter is exact at every read; memory.stat's
    parts are per-CPU counters the kernel folds in every few seconds, so anon from it moves in
    steps (a trend over it would dip and jump), while the page cache it subtracts moves slowly.
    The usage alone where memory.stat could not be read."""
    if cg.usage_bytes is None:
        return None
    if cg.charge is not None:
        return max(0, cg.usage_bytes - cg.charge.file_bytes)
    return cg.usage_bytes


def _size(n: float) -> str:
    return gib_or_mib(n, 2)


class Foresight:
    """Fed every snapshot by the sampler's thread (``update``); read by the death watch
    (``warnings``) from its own threads, so the warning lists are replaced, never mutated
    in place under a reader."""

    def __init__(self, *, warn_seconds: float = WARN_SECONDS, wall: Callable[[], float] = time.time) -> None:
        self.warn_seconds = warn_seconds
        self.wall = wall
        self._limits: dict[str, Series] = {}  # "host" or a cgroup path
        self._ranks: dict[ProcKey, Series] = {}
        self._episodes: dict[ProcKey, _Episode] = {}
        self._warnings: dict[str, tuple[Warned, ...]] = {}

    def warnings(self, job: str) -> tuple[Warned, ...]:
        """The warnings given for a job, oldest first (at most ``WARNINGS_PER_JOB``)."""
        return self._warnings.get(job, ())

    def update(self, snapshot: Snapshot) -> Snapshot:
        """Feed one round; returns the snapshot with its predictions filled in."""
        t = snapshot.monotonic
        host = snapshot.host
        live_limits: set[str] = set()
        headroom: dict[str, tuple[MemoryLimit, float]] = {}
        if host is not None:
            if snapshot.detail:  # else the host's figures are the last detailed round's
                self._series(self._limits, "host").add(t, host.total_bytes - host.available_bytes)
            live_limits.add("host")
            headroom["host"] = (MemoryLimit("host", None, host.total_bytes), float(host.available_bytes))
        cgroups = {c.path: c for c in snapshot.cgroups}
        annotated: list[CgroupSample] = []
        for cg in snapshot.cgroups:
            committed = _committed(cg)
            if cg.limit_bytes is None or committed is None:
                annotated.append(cg)
                continue
            series = self._series(self._limits, cg.path)
            series.add(t, committed)
            live_limits.add(cg.path)
            room = float(max(0, cg.limit_bytes - committed))
            headroom[cg.path] = (MemoryLimit("cgroup", cg.path, cg.limit_bytes), room)
            seconds = self._seconds(room, series.rate)
            annotated.append(cg if seconds is None else evolve(cg, exhaustion_seconds=seconds))
        for path in [p for p in self._limits if p not in live_limits]:
            del self._limits[path]

        live_ranks: set[ProcKey] = set()
        jobs = []
        for job in snapshot.jobs:
            ranks: list[RankSample] = []
            for rank in job.ranks:
                live_ranks.add(rank.key)
                ranks.append(self._rank(job.key, rank, cgroups, headroom, t, snapshot.detail))
            jobs.append(evolve(job, ranks=tuple(ranks)))
        for key in [k for k in self._ranks if k not in live_ranks]:
            del self._ranks[key]
        for key in [k for k in self._episodes if k not in live_ranks]:
            del self._episodes[key]
        live_jobs = {j.key for j in snapshot.jobs}
        if len(self._warnings) > 64:  # bounded: keep the live jobs' and the newest others'
            keep = [k for k in self._warnings if k in live_jobs] + list(self._warnings)[-32:]
            self._warnings = {k: self._warnings[k] for k in dict.fromkeys(keep)}
        return evolve(snapshot, jobs=tuple(jobs), cgroups=tuple(annotated))

    @staticmethod
    def _series(table: dict[str, Series], key: str) -> Series:
        series = table.get(key)
        if series is None:
            series = table[key] = Series()
        return series

    @staticmethod
    def _seconds(room: float, rate: float | None) -> float | None:
        if rate is None:
            return None
        seconds = room / rate
        return round(seconds, 1) if seconds <= MAX_SECONDS else None

    def _binding(
        self,
        rank: RankSample,
        cgroups: dict[str, CgroupSample],
        headroom: dict[str, tuple[MemoryLimit, float]],
    ) -> str | None:
        """The key of the limit a rank would meet first: its tightest cgroup limit unless
        the host has less room left than that limit does."""
        cg = cgroups.get(rank.cgroup or "")
        candidates = []
        if cg is not None and cg.limited_by is not None and cg.limited_by in headroom:
            candidates.append(cg.limited_by)
        if "host" in headroom:
            candidates.append("host")
        if not candidates:
            return None
        return min(candidates, key=lambda k: headroom[k][1])

    def _rank(
        self,
        job: str,
        rank: RankSample,
        cgroups: dict[str, CgroupSample],
        headroom: dict[str, tuple[MemoryLimit, float]],
        t: float,
        detail: bool = True,
    ) -> RankSample:
        binding = self._binding(rank, cgroups, headroom)
        if binding is None:
            return rank
        limit, room = headroom[binding]
        limit_series = self._limits[binding]
        seconds = None
        if rank.tree_unreclaimable_bytes is not None:
            series = self._ranks.get(rank.key)
            if series is None:
                series = self._ranks[rank.key] = Series()
            # the rank's own trend is what says *it* is growing; the limit's trend says how
            # fast the room goes (other ranks and processes under the limit count there).
            # A prediction needs both, so a rank's trend is judged only while its limit's
            # charge grows (confirmed or not): its points are kept all along, and a rank
            # that grows with its limit is confirmed in the same round as the limit.
            if detail:  # else the rank's status is the last detailed round's
                series.add(t, rank.tree_unreclaimable_bytes, judge=limit_series.growing_since is not None)
            if series.rate is not None:
                seconds = self._seconds(room, limit_series.rate)
        if seconds is not None and limit_series.rate is not None:
            self._episode(job, rank, limit, seconds, limit_series.rate, t)
        elif (episode := self._episodes.get(rank.key)) is not None:
            episode.lapsed = True
        return evolve(rank, binding_limit=limit, exhaustion_seconds=seconds)

    def _episode(
        self, job: str, rank: RankSample, limit: MemoryLimit, seconds: float, rate: float, t: float
    ) -> None:
        episode = self._episodes.get(rank.key)
        if episode is None or t - episode.last_seen > EPISODE_GAP_SECONDS:
            episode = self._episodes[rank.key] = _Episode(t)
        episode.last_seen = t
        news = _news(episode, seconds, t) if seconds <= self.warn_seconds else None
        if news is None:
            return
        episode.deadline, episode.lapsed = t + seconds, False
        warning = Warned(self.wall(), job, rank.rank, rank.rank_label, rank.restart, seconds, rate, limit)
        self._warnings[job] = (*self._warnings.get(job, ())[-(WARNINGS_PER_JOB - 1) :], warning)
        where = f"cgroup {limit.path}" if limit.kind == "cgroup" else "the host's memory (a global OOM)"
        log.warning(
            "memory: rank %s of job %s is growing; at this trend (%s/s) the limit of %s (%s) is "
            "reached in %.0f s%s",
            rank.rank_label,
            job,
            _size(rate),
            where,
            _size(limit.limit_bytes),
            seconds,
            news,
        )
