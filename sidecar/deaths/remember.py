"""A death remembered: what the death watch knows, kept on disk (``journal.py``) so that a
restarted daemon judges the deaths that happened while it was down (``reconstruct.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from sidecar import lognames
from sidecar.deaths.gather import Gatherer
from sidecar.deaths.journal import SAVE_EVERY_S, Journal
from sidecar.deaths.reconstruct import incidents_of, killed_at, revive, state_of, watched
from sidecar.deaths.saved import SavedState, thin
from sidecar.deaths.state import Watched
from sidecar.deaths.write import TIMELINE_WINDOW_S
from sidecar.sampling.timeline import Timeline

__all__ = ["JournalKeeper"]

log = logging.getLogger(lognames.DEATHS)


class JournalKeeper:
    """Saves the watch's state (``save``) and takes it back at start (``restore``). Without a
    journal (or a boot id, without which a saved pid could name another process) it keeps
    nothing."""

    def __init__(
        self,
        state: Watched,
        gather: Gatherer,
        timeline: Timeline,
        journal: Journal | None,
        boot_id: str | None,
        clock_ns: Callable[[], int],
        wall: Callable[[], float],
    ) -> None:
        self.state = state
        self.gather = gather
        self.timeline = timeline
        self.journal = journal if boot_id is not None else None  # without a boot id it could mislead
        self.boot_id = boot_id or ""
        self.clock_ns = clock_ns
        self.wall = wall
        self._at = 0  # monotonic ns of the last save
        self._sig: object = None  # what the last save held, in short

    def save(self, now: int) -> None:
        """Write the journal when what it would hold changed, else every SAVE_EVERY_S
        while ranks are watched. Built under the lock, written outside it."""
        if self.journal is None:
            return
        with self.state.cv:
            latest = self.state.snapshots[-1] if self.state.snapshots else None
            ranks, substance = watched(self.state.known, latest, self.state.incidents.values())
            if substance == self._sig and (not ranks or now - self._at < SAVE_EVERY_S * 1e9):
                return
            self._sig, self._at = substance, now
            state = state_of(
                self.boot_id,
                now,
                self.wall(),
                ranks,
                latest,
                self.state.incidents.values(),
                self.state.agent_outputs,
                {pid: files for pid, (files, _) in self.state.rank_files.items()},
            )
        since = self.wall() - TIMELINE_WINDOW_S
        curves = {job: thin(self.timeline.window(job, since)) for job in {k.gen.job for k in state.ranks}}
        self.journal.save(replace(state, curves=curves))

    def restore(self, state: SavedState) -> int:
        """At start, with the kernel log's history already fed in (``on_kmsg``): judge the
        deaths of the saved ranks that happened while the daemon was down, from that
        history, the agent's log and the cgroups' counters. Returns how many jobs."""
        now = self.clock_ns()
        with self.state.cv:
            kills = [(k.pid, k.at_ns) for k in self.state.records.ooms.kills]
        revived = revive(state, self.gather.alive, killed_at(kills), now)
        for job, points in state.curves.items():
            self.timeline.restore(job, list(points))
        with self.state.cv:
            self.state.agent_outputs.update({p: list(f) for p, f in state.agent_files.items()})
            for r, inc in zip(revived, incidents_of(state, revived, now, self.wall()), strict=True):
                for pid, k in r.ranks.items():
                    self.state.known.setdefault(pid, k)
                    self.state.rank_files.setdefault(
                        pid, (list(state.rank_files.get(pid, ())), state.saved_wall)
                    )
                self.state.incidents[r.gen] = inc
                self.state.schedule(inc, now)
                log.warning(
                    "job %s: %d rank(s) died while trainwatch was down (pids %s); judging from the "
                    "kernel log's history and the agent's log",
                    r.gen.job,
                    len(r.new_dead),
                    ", ".join(map(str, r.new_dead)),
                )
        return len(revived)
