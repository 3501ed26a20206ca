"""What each rank's tree really holds: PSS and USS, off the hot path.

RSS counts a page once per process that maps it, so a rank and its forked DataLoader
workers, sharing the dataset's pages, are counted several times over; and copy-on-access
growth (a worker touching Python objects un-shares their pages) hides inside RSS. PSS
splits each page among the processes that map it (the tree's PSS adds up to what it holds);
USS counts only the pages a process alone maps (what goes when it exits).

They come from ``/proc/PID/smaps_rollup``, for which the kernel walks every mapping of the
process: milliseconds for a large one, under its mmap lock. So a tree is measured every
``EVERY_S`` seconds, sooner (but not within ``MIN_GAP_S``) when its RSS, or the usage of
the limit it lives under (its cgroup's, else the host's), grew by ``GROWTH`` since the
last measurement: copy-on-access never moves RSS (the pages were mapped before the fork)
but is charged to the limit as it happens. And never so often that the measuring, all trees
together, takes more than ``CORE_SHARE`` of a core on average: a measurement that took
``t`` seconds of CPU holds every other one back for ``t / CORE_SHARE`` seconds. Many large
trees are then each measured less often than every ``EVERY_S``; the cost stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.errors import NoSuchProcess, ProbeError
from sidecar.model import ProcKey

__all__ = ["PssSampler"]

EVERY_S = 30.0  # a tree whose memory does not move: measured twice a minute
MIN_GAP_S = 1.0
GROWTH = 0.10
CORE_SHARE = 0.01
MAX_WORKERS = 64  # descendants listed per rank (all still count in the tree's totals)


# (pid, USS now, USS when first measured) of each of a rank's descendants: copy-on-access
# growth (a forked DataLoader worker un-sharing the dataset's pages) shows here and nowhere
# else, since the pages stay resident and anonymous, only no longer shared
Workers = tuple[tuple[int, int, int], ...]


@dataclass(slots=True)
class _Measured:
    at: float
    next_at: float  # due again, growth or not
    tree_rss: int
    limit_used: int | None
    pss: int | None  # None: no process of the tree could be measured (no smaps_rollup here)
    uss: int | None
    workers: Workers = ()


class PssSampler:
    """Per rank, the latest (PSS, USS) of its tree; measured when due. One sampler thread."""

    def __init__(
        self,
        rollup: Callable[[int], tuple[int, int]],
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        self._rollup = rollup
        self._clock = clock
        self._cpu = cpu
        self._last: dict[ProcKey, _Measured] = {}
        self._free_at = 0.0  # no measurement before: the last one's cost, at CORE_SHARE of a core
        self._waiting: dict[ProcKey, float] = {}  # trees due but held back, and since when
        self.measured_total = 0  # trees measured
        self.cpu_seconds = 0.0  # spent measuring

    def of(
        self, rank: ProcKey, tree: list[int], tree_rss: int, limit_used: int | None = None
    ) -> tuple[int | None, int | None, Workers]:
        """The tree's (PSS, USS, workers), measured now if it is due, else as last measured;
        (None, None, ()) before the first measurement. ``limit_used``: what the limit the
        rank lives under holds now (bytes)."""
        now = self._clock()
        last = self._last.get(rank)
        due = last is None or now >= last.next_at
        if last is not None and not due and now - last.at >= MIN_GAP_S:
            due = tree_rss > last.tree_rss * (1 + GROWTH) or (
                limit_used is not None
                and last.limit_used is not None
                and limit_used > last.limit_used * (1 + GROWTH)
            )
        if due:  # in turn: the tree that has waited longest goes first (none starves)
            since = self._waiting.setdefault(rank, now)
            due = now >= self._free_at and since <= min(self._waiting.values())
        if not due:
            return (last.pss, last.uss, last.workers) if last is not None else (None, None, ())
        started = self._cpu()
        pss = uss = 0
        measured = 0
        first = {pid: u0 for pid, _, u0 in last.workers} if last is not None else {}
        workers: list[tuple[int, int, int]] = []
        for i, pid in enumerate(tree):
            try:
                p, u = self._rollup(pid)
            except (NoSuchProcess, ProbeError):
                continue  # gone, a zombie, or not ours to read: the rest still count
            measured += 1
            pss += p
            uss += u
            if i and len(workers) < MAX_WORKERS:
                workers.append((pid, u, first.get(pid, u)))
        cost = max(0.0, self._cpu() - started)
        self.measured_total += 1
        self.cpu_seconds += cost
        self._free_at = now + cost / CORE_SHARE
        del self._waiting[rank]
        kept = tuple(workers)
        if not measured:  # nothing read (a kernel without smaps_rollup, every read refused): unknown, not 0
            self._last[rank] = _Measured(now, now + EVERY_S, tree_rss, limit_used, None, None, ())
            return None, None, ()
        self._last[rank] = _Measured(now, now + EVERY_S, tree_rss, limit_used, pss, uss, kept)
        return pss, uss, kept

    def last(self, rank: ProcKey) -> tuple[int | None, int | None, Workers]:
        """The tree's (PSS, USS, workers) as last measured, nothing measured (a round
        between two detailed ones: whether one is due is asked once a second)."""
        m = self._last.get(rank)
        return (None, None, ()) if m is None else (m.pss, m.uss, m.workers)

    def forget(self, live: set[ProcKey]) -> None:
        """Drop the ranks that are gone."""
        for key in [k for k in self._last if k not in live]:
            del self._last[key]
        for key in [k for k in self._waiting if k not in live]:
            del self._waiting[key]
