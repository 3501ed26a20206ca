"""Each rank's own reads in a round: its ``stat`` and ``status`` (or, between detailed rounds
with the connector telling exits, its ``statm`` through a held descriptor), its descendants'
RSS, and its tree's PSS/USS when due. Part of the sampling round (``sampler.py``); cgroups
and GPUs are read by their own rooms (``cgroups.py``, ``gpus.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from sidecar.errors import NoSuchProcess, ProbeError
from sidecar.model import ProcKey
from sidecar.model.events import ExitEvent
from sidecar.probes.proc import ProcReader, ProcStat, ProcStatus
from sidecar.probes.pss import PssSampler
from sidecar.probes.zombies import zombie_status
from sidecar.sampling.discovery import Discovery
from sidecar.sampling.jobs import TrackedRank

__all__ = ["RankRead", "RankReader"]


class RankRead(NamedTuple):
    """What one round read of a rank, before cgroup and GPU attribution."""

    rss_bytes: int
    peak_rss_bytes: int | None
    cpu_seconds: float
    threads: int
    tree_rss_bytes: int
    tree_processes: int
    tree: list[int]
    ns_pids: tuple[int, ...]
    uid: int | None
    tree_pss_bytes: int | None
    tree_uss_bytes: int | None
    tree_unreclaimable_bytes: int | None
    workers_uss: tuple[tuple[int, int, int], ...]


class RankReader:
    """Reads one rank a round; keeps the last detailed round's ``stat`` and ``status`` of
    each live rank, which the rounds between two detailed ones carry."""

    def __init__(self, proc: ProcReader, discovery: Discovery, pss: PssSampler, *, smaps: bool) -> None:
        self.proc = proc
        self.discovery = discovery
        self.pss = pss
        self.smaps = smaps
        self._statuses: dict[ProcKey, ProcStatus] = {}  # the last detailed round's
        self._stats: dict[ProcKey, ProcStat] = {}  # likewise (CPU time, threads)
        # Called with a rank's zombie exit status: the fallback when the process connector
        # is unavailable (the agent reaps within 0.1 s, so this sees a death only by luck).
        self.on_zombie: Callable[[ExitEvent], None] | None = None

    def keep_only(self, live: set[ProcKey]) -> None:
        """Forgets what it kept of ranks no longer live."""
        self.pss.forget(live)
        for key in [k for k in self._statuses if k not in live]:
            del self._statuses[key]
        for key in [k for k in self._stats if k not in live]:
            del self._stats[key]

    def read(
        self,
        pid: int,
        tracked: TrackedRank,
        detail: bool,
        limit_used: Callable[[ProcKey], int | None],
    ) -> RankRead | None:
        """The rank's round, or None when it is no longer a live rank (gone, another
        process under its pid, a zombie, or without an address space). ``limit_used``: what
        the limit the rank lives under held at the last round (for when PSS is due)."""
        proc, discovery = self.proc, self.discovery
        key = tracked.key
        light = not detail and self.on_zombie is None and discovery.hears_changes and proc.keeps
        st = self._stats.get(key) if light else None
        status = self._statuses.get(key) if st is not None else None
        if st is not None and status is not None:
            # Between detailed rounds, with the connector telling exits: the rank's RSS from
            # statm through its held descriptor (stat would sum its threads' CPU times, and
            # a training process has dozens); its CPU time, threads and status as the last
            # detailed round read them.
            def still_the_rank(p: int) -> bool:  # before its statm descriptor is first opened
                return proc.stat(p).start_ticks == key.start_ticks

            rss, alive, gone = proc.rss_kept_sum([pid], still_the_rank)
            if gone:
                discovery.forget(pid)
                return None
            if not alive:
                return None  # no address space any more: killed and exiting, not a live rank
            fresh = False
        else:
            try:
                st = proc.stat_kept(pid)
                if st.start_ticks != key.start_ticks:
                    discovery.forget(pid)
                    return None
                if st.state in ("Z", "X"):
                    told = zombie_status(st)  # None where this kernel does not tell it
                    if self.on_zombie is not None and told is not None:
                        now_ns = time.monotonic_ns()
                        self.on_zombie(ExitEvent(pid, told, st.ppid, now_ns, source="proc"))
                    return None  # dead, not yet reaped by the agent: no longer a live rank
                if detail:
                    self._stats[key] = st
                status = None if detail else self._statuses.get(key)
                fresh = status is None
                if status is None:
                    status = self._statuses[key] = proc.status_kept(pid)
            except NoSuchProcess:
                discovery.forget(pid)
                return None
            if status.rss_bytes is None or st.rss_bytes == 0:
                return None  # no address space any more: killed and exiting, not a live rank
            # VmRSS; between detailed rounds stat's, from the same counters
            rss = status.rss_bytes if fresh else st.rss_bytes
        tree = discovery.tree_of(pid)
        if discovery.hears_changes and proc.keeps:
            tree_rss, members = self._tree_kept(tree, rss)
        else:
            tree_rss, members = self._tree_by_stat(tree, rss)
        pss: int | None = None
        uss: int | None = None
        workers: tuple[tuple[int, int, int], ...] = ()
        if self.smaps:
            if detail:  # due every 30 s, sooner on growth: asked once a second
                pss, uss, workers = self.pss.of(key, tree, tree_rss, limit_used(key))
            else:
                pss, uss, workers = self.pss.last(key)
        return RankRead(
            rss,
            status.peak_rss_bytes,
            st.cpu_seconds,
            st.threads,
            tree_rss,
            members,
            tree,
            status.ns_pids,
            status.uid,
            pss,
            uss,
            # the rank's own (status: this round, or the last detailed one) and its descendants' RSS
            None if status.anon_shmem_bytes is None else status.anon_shmem_bytes + tree_rss - rss,
            workers,
        )

    def _tree_kept(self, tree: list[int], rss: int) -> tuple[int, int]:
        """The tree's RSS and size from held ``statm`` descriptors. The connector tells
        discovery of every exit and fork in the tree, and a held descriptor cannot read
        another process: statm's RSS is all a round needs."""
        proc, discovery = self.proc, self.discovery

        def same(child: int) -> bool:  # before a child's descriptor is first opened
            seen = discovery.seen(child)
            try:
                return seen is not None and proc.stat(child).start_ticks == seen[0].start_ticks
            except NoSuchProcess:
                return False  # (another ProbeError skips the child this round)

        tree_rss, members = rss, 1
        children = [child for child in tree[1:] if discovery.seen(child) is not None]
        if children:
            rss_sum, alive, gone = proc.rss_kept_sum(children, same)
            tree_rss += rss_sum
            members += alive
            for child in gone:  # exited, or the pid is another process's already
                discovery.forget(child)
        return tree_rss, members

    def _tree_by_stat(self, tree: list[int], rss: int) -> tuple[int, int]:
        """The descendants' RSS from their stat, checking each is still the process
        discovery saw (start time) and where (parent): without the connector, nothing
        else tells."""
        discovery = self.discovery
        stat_brief = self.proc.stat_brief_kept
        tree_rss, members = rss, 1
        for child in tree[1:]:
            seen = discovery.seen(child)
            if seen is None:
                continue
            key, parent = seen
            try:
                state, ppid, start_ticks, child_rss = stat_brief(child)
            except NoSuchProcess:
                discovery.forget(child)
                continue
            except ProbeError:
                continue
            if start_ticks != key.start_ticks:
                discovery.forget(child)
                continue
            if ppid != parent:
                discovery.reparent(child, ppid)
            if state in ("Z", "X"):
                continue
            tree_rss += child_rss
            members += 1
        return tree_rss, members
