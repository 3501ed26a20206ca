"""The deaths a node's death watch counted: what ``/metrics`` exports of them
(``trainwatch_rank_deaths_total``, ``trainwatch_rank_death_timestamp_seconds``) and what the
strand tracker ties survivors to. Written by the death watch's worker, read by the scrape and
the sampler's thread without a lock: so it is immutable, and a count makes a new ledger that
the worker swaps in whole."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["DEATH_TIMES", "DeathKey", "DeathLedger"]

DEATH_TIMES = 64  # the newest deaths whose time is kept (a dashboard's annotations, a story's first death)

# (job key, rank label, restart): one rank's death in one generation of its job
DeathKey = tuple[str, str, int]


@dataclass(frozen=True, slots=True)
class DeathLedger:
    """``totals``: (job, killer) -> the deaths counted; ``times``: the newest ``DEATH_TIMES``
    deaths, oldest first, each (killer, wall time of death)."""

    totals: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
    times: Mapping[DeathKey, tuple[str, float]] = field(default_factory=lambda: MappingProxyType({}))

    def counted(self, key: DeathKey, killer: str, at: float, keep: int = DEATH_TIMES) -> DeathLedger:
        """This ledger and one death more: its job's count for ``killer`` up by one, and its
        time the newest (a death counted again under the same key moves to the end); the
        oldest times past ``keep`` are dropped."""
        job = key[0]
        totals = dict(self.totals)
        totals[(job, killer)] = totals.get((job, killer), 0) + 1
        times = {k: v for k, v in self.times.items() if k != key}
        times[key] = (killer, at)
        for old in list(times)[: max(0, len(times) - keep)]:
            del times[old]
        return DeathLedger(MappingProxyType(totals), MappingProxyType(times))
