"""What filled the limit: from the charge at the kill (memory.stat of the binding cgroup)
and the ranks' memory curves before it, the one thing that took the room, so the advice
can be about it. Each class is a mechanism the numbers show, never a guess from names:

- ``shmem``: shared memory (tmpfs, /dev/shm, shared anonymous mappings) made up much of
  the charge: it is charged to the cgroup that touched it first and no reclaim takes it.
- ``page_cache``: file pages made up much of a v1 charge at the kill (v1 counts them
  toward the limit and kills when it cannot reclaim them fast enough: dirty pages of a
  checkpoint being written, mapped dataset files).
- ``one_rank``: one rank's tree grew and the others did not: a leak in that rank.
- ``every_rank``: every rank grew alike and held about the same: each loads its own copy.
- ``workers``: the growth was in the ranks' child processes (DataLoader workers), not in
  the ranks: their RSS, or, for copy-on-access (a forked worker un-sharing the dataset's
  pages, which RSS never shows), their USS against the charge's growth.

None when the numbers name nothing (no curve, no growth worth naming, a mix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.model import MemoryCharge, TimelinePoint
from sidecar.trend import theil_sen

__all__ = ["Filling", "what_filled"]

SHARE = 0.4  # a part of the charge this large at the kill is what filled it
GROWTH_BYTES = 256 * 2**20  # less growth than this over the window names nothing
ONE_RANK_SHARE = 0.6  # one rank's share of the growth to be "the leak of one rank"
OTHERS_AT_MOST = 0.3  # ... while no other rank grew more than this fraction of it
ALIKE = 0.5  # every rank grew at least this fraction of the largest growth
WORKERS_SHARE = 0.5  # the children's share of the growth to be "the workers"
RATE_WINDOW_S = 30.0  # a leak's rate: over its last stretch before the kill
# the workers' USS last measured this long before the curve's end cannot speak for the growth
# since (a loaded node measures it seldom: probes/pss.py holds it to 1 % of a core)
STALE_USS_S = 15.0


@dataclass(frozen=True, slots=True)
class Filling:
    kind: str  # shmem, page_cache, one_rank, every_rank, workers
    part_bytes: int = 0  # shmem / page_cache: that part of the charge
    total_bytes: int = 0  # shmem / page_cache: the charge
    rank: str | None = None  # one_rank: its label
    grown_bytes: int = 0  # one_rank / workers: growth over the window
    rate_bytes_per_second: float | None = None  # one_rank: over its last stretch
    seconds: float = 0.0  # the window the growth was measured over
    held: dict[str, int] = field(default_factory=dict)  # every_rank: each rank's tree RSS at the end
    unique: bool = False  # workers: growth of their USS (else of their RSS)


def _slope(points: list[tuple[float, int]]) -> float | None:
    """The trend foresight uses (robust to one outlier)."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return theil_sen([(t, float(v)) for t, v in points])


def _unreclaimable(charge: dict[str, int]) -> int:
    return charge.get("anon", 0) + charge.get("shmem", 0)


def _unshared(points: list[TimelinePoint]) -> tuple[int, int, float] | None:
    """(growth of the workers' USS, growth of the charge, seconds) between the first and the
    last USS measurement (a point carries the last measured values: each counts from the
    point it first appeared in); the charge's growth is the tree RSS's where no charge was
    read. None with fewer than two measurements, or the last one ``STALE_USS_S`` before the
    end (the growth after it unmeasured): the RSS then tells what it can."""
    measured = [p for p in points if p.workers_uss_bytes]
    if len(measured) < 2:
        return None
    a = measured[0]
    b = next(p for p in measured if p.workers_uss_bytes == measured[-1].workers_uss_bytes)
    if b.at <= a.at or points[-1].at - b.at > STALE_USS_S:
        return None
    grown = sum(max(0, n - a.workers_uss_bytes.get(k, 0)) for k, n in b.workers_uss_bytes.items())
    if "anon" in a.cgroup_charge_bytes and "anon" in b.cgroup_charge_bytes:
        basis = _unreclaimable(b.cgroup_charge_bytes) - _unreclaimable(a.cgroup_charge_bytes)
    else:
        basis = sum(
            max(0, n - a.tree_rss_bytes[k]) for k, n in b.tree_rss_bytes.items() if k in a.tree_rss_bytes
        )
    return grown, basis, b.at - a.at


def _by_charge(charge: MemoryCharge | None, version: int | None) -> Filling | None:
    if charge is None:
        return None
    total = charge.anon_bytes + charge.file_bytes + charge.shmem_bytes + (charge.kernel_bytes or 0)
    if total <= 0:
        return None
    if charge.shmem_bytes >= SHARE * total and charge.shmem_bytes >= charge.anon_bytes:
        return Filling("shmem", part_bytes=charge.shmem_bytes, total_bytes=total)
    if version == 1 and charge.file_bytes >= SHARE * total and charge.file_bytes >= charge.anon_bytes:
        return Filling("page_cache", part_bytes=charge.file_bytes, total_bytes=total)
    return None


def _by_curves(points: list[TimelinePoint]) -> Filling | None:
    # each rank from its first to its last point: a rank the kill took is gone from the
    # samples after it, the others are not
    first: dict[str, TimelinePoint] = {}
    last: dict[str, TimelinePoint] = {}
    for p in points:
        for k in p.tree_rss_bytes:
            first.setdefault(k, p)
            last[k] = p
    labels = [k for k in first if last[k].at > first[k].at]
    if not labels:
        return None
    seconds = max(last[k].at for k in labels) - min(first[k].at for k in labels)
    grown = {k: last[k].tree_rss_bytes[k] - first[k].tree_rss_bytes[k] for k in labels}
    total = sum(max(0, g) for g in grown.values())
    # copy-on-access grows the charge and the workers' USS, not anyone's RSS (the pages were
    # resident and mapped before, shared; now each worker has its own copy)
    charged = [p.cgroup_charge_bytes for p in points if "anon" in p.cgroup_charge_bytes]
    charge_growth = _unreclaimable(charged[-1]) - _unreclaimable(charged[0]) if len(charged) > 1 else 0
    if max(total, charge_growth) < GROWTH_BYTES:
        return None

    def children(p: TimelinePoint, k: str) -> int:
        return p.tree_rss_bytes[k] - p.rss_bytes.get(k, p.tree_rss_bytes[k])

    # the workers' USS where it was measured: their RSS jumps at the fork by pages they share
    # (counted once per process) and stays flat while copy-on-access makes them their own
    unshared = _unshared(points)
    if unshared is not None:
        workers, basis, span = unshared
        if workers >= GROWTH_BYTES and workers >= WORKERS_SHARE * basis:
            return Filling("workers", grown_bytes=workers, seconds=span, unique=True)
    else:
        workers = sum(max(0, children(last[k], k) - children(first[k], k)) for k in labels)
        if workers >= GROWTH_BYTES and workers >= WORKERS_SHARE * max(total, charge_growth):
            return Filling("workers", grown_bytes=workers, seconds=seconds)
    if total < GROWTH_BYTES:
        return None
    top = max(labels, key=lambda k: grown[k])
    others = [grown[k] for k in labels if k != top]
    if grown[top] >= ONE_RANK_SHARE * total and all(g <= OTHERS_AT_MOST * grown[top] for g in others):
        end = last[top].at
        recent = [
            (p.at, p.tree_rss_bytes[top])
            for p in points
            if top in p.tree_rss_bytes and p.at >= end - RATE_WINDOW_S
        ]
        return Filling(
            "one_rank",
            rank=top,
            grown_bytes=grown[top],
            rate_bytes_per_second=_slope(recent),
            seconds=seconds,
        )
    if len(labels) > 1 and min(grown.values()) >= ALIKE * grown[top]:
        held = {k: last[k].tree_rss_bytes[k] for k in labels}
        return Filling("every_rank", grown_bytes=total, seconds=seconds, held=held)
    return None


def what_filled(
    charge: MemoryCharge | None, version: int | None, points: list[TimelinePoint]
) -> Filling | None:
    """What filled the limit: a part of the charge at the kill, else who grew before it."""
    return _by_charge(charge, version) or _by_curves(points)
