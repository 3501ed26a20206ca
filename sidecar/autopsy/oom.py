"""The one fold of kernel OOM records, for the live daemon and ``trainwatch diagnose``.

One OOM kill is told by several kernel log records: the ``oom-kill:`` summary (the scope,
the cgroup whose limit was hit, the victim's cgroup) and the ``Killed process`` line (the
RSS), and before Linux 5.0 a ``Task in /a killed as a result of limit of /b`` line ahead of
the kill. ``OomFold`` merges them into one ``KernelOom`` per kill: records of one pid within
``WINDOW_NS`` of each other are one kill. The daemon feeds it kernel times; ``diagnose``
feeds 0 for every line (its lines' order is their time), which merges by pid alone.
"""

from __future__ import annotations

from collections import deque

from sidecar.autopsy.evidence import KernelOom
from sidecar.parse.kernel import OomKill, OomMemcgLimit, OomSummary

__all__ = ["WINDOW_NS", "OomFold"]

WINDOW_NS = 5 * 10**9


class OomFold:
    """OOM kills merged from their records, oldest first, at most ``maxlen`` kept."""

    def __init__(self, maxlen: int | None = None) -> None:
        self.kills: deque[KernelOom] = deque(maxlen=maxlen)
        self._limit: tuple[str, int] | None = None  # the last "limit of X" line and its time

    def feed(self, parsed: OomMemcgLimit | OomSummary | OomKill, text: str, at_ns: int) -> KernelOom | None:
        """Add one parsed record (its raw ``text``, its time). Returns the kill it belongs to
        as merged so far, or None for a "limit of" line (kept for the kill that follows)."""
        if isinstance(parsed, OomMemcgLimit):
            self._limit = (parsed.oom_memcg, at_ns)
            return None
        if isinstance(parsed, OomSummary):
            scope = "global" if parsed.global_oom else "memcg"
            fresh = KernelOom(
                parsed.pid, at_ns, scope, parsed.oom_memcg, parsed.task_memcg, parsed.comm, None, (text,)
            )
        else:
            limit = self._limit
            memcg = limit[0] if limit and parsed.scope == "memcg" and at_ns - limit[1] < WINDOW_NS else None
            fresh = KernelOom(
                parsed.pid, at_ns, parsed.scope, memcg, None, parsed.comm, parsed.rss_bytes, (text,)
            )
        for i in range(len(self.kills) - 1, -1, -1):
            known = self.kills[i]
            if known.pid == parsed.pid and abs(known.at_ns - at_ns) < WINDOW_NS:
                merged = known.merged(fresh)
                self.kills[i] = merged
                return merged
        self.kills.append(fresh)
        return fresh
