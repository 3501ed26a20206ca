"""Each round's memory cgroups: which cgroup each rank lives in (rechecked every
``CGROUP_RECHECK_SECONDS``), and their samples. Every round reads each cgroup's usage; a
detailed round (or one whose cgroup grew fast toward its limit) reads the other files too,
and the limited ancestors above it. A cgroup whose ranks left lingers for
``CGROUP_LINGER_SECONDS`` so its OOM kill reaches a scrape. Part of the sampling round
(``sampler.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from sidecar.errors import NoSuchProcess, ProbeError
from sidecar.model import CgroupSample, HostSample, ProcKey, evolve
from sidecar.probes.cgroup import CgroupReader, MemoryCgroupRef
from sidecar.probes.proc import ProcReader
from sidecar.sampling.jobs import TrackedRank

__all__ = ["CGROUP_LINGER_SECONDS", "CGROUP_RECHECK_SECONDS", "FAST_GROWTH_SHARE", "CgroupRounds"]

_V = TypeVar("_V")

CGROUP_RECHECK_SECONDS = 10.0
# A cgroup whose usage grew by this share of its limit since its last full read is read in
# full that round, detailed or not
FAST_GROWTH_SHARE = 0.05
# A cgroup's series stay this long after its last rank left: the OOM kill that emptied it
# must reach a scrape as an increment of trainwatch_cgroup_oom_kills_total (the agent tears
# the other ranks down within a second, before a 5 s scrape sees the new count).
CGROUP_LINGER_SECONDS = 120.0


def _with_usage(sample: CgroupSample, usage: int | None) -> CgroupSample:
    """A cgroup's last detailed sample with this round's usage; its peak is at least that
    usage (the peak counter is the usage's maximum, read with the other files)."""
    if usage is None:
        return sample
    peak = sample.peak_bytes
    return evolve(sample, usage_bytes=usage, peak_bytes=None if peak is None else max(peak, usage))


@dataclass(slots=True)
class _RankCgroup:
    ref: MemoryCgroupRef | None
    checked_at: float


class CgroupRounds:
    """The cgroups' part of each round; ``problem`` is the round's cgroup problem, if any."""

    def __init__(self, cgroups: CgroupReader, proc: ProcReader, clock: Callable[[], float]) -> None:
        self.cgroups = cgroups
        self.proc = proc
        self.clock = clock
        self.problem: str | None = None
        self._rank_cgroups: dict[ProcKey, _RankCgroup] = {}
        self._recent: dict[str, tuple[MemoryCgroupRef, float]] = {}  # path -> (ref, last used)
        self._last: dict[str, CgroupSample] = {}  # path -> the last detailed sample

    def limit_used(self, key: ProcKey, host: HostSample | None) -> int | None:
        """What the limit a rank lives under held at the last round: its cgroup's usage, else
        the host's memory in use (None before either was read)."""
        cached = self._rank_cgroups.get(key)
        if cached is not None and cached.ref is not None:
            sample = self._last.get(cached.ref.path)
            if sample is not None and sample.usage_bytes is not None:
                return sample.usage_bytes
        return None if host is None else host.total_bytes - host.available_bytes

    def _read(
        self, path: str, read: Callable[[MemoryCgroupRef], _V], ref: MemoryCgroupRef
    ) -> tuple[bool, _V | None]:
        """(True, what ``read`` gave), or (False, None) when the cgroup is gone (no longer
        lingered over) or unreadable (the round's cgroup problem)."""
        try:
            return True, read(ref)
        except NoSuchProcess:
            self._recent.pop(path, None)
        except ProbeError as exc:
            self.problem = str(exc)
        return False, None

    def _refs(self, ranks: list[TrackedRank]) -> tuple[dict[str, MemoryCgroupRef], dict[ProcKey, str]]:
        """The cgroups to read this round (the ranks', and those lingering), and each
        rank's cgroup path."""
        now = self.clock()
        live = {tracked.key for tracked in ranks}
        for key in [k for k in self._rank_cgroups if k not in live]:
            del self._rank_cgroups[key]
        refs: dict[str, MemoryCgroupRef] = {}
        rank_cgroup: dict[ProcKey, str] = {}
        for tracked in ranks:
            cached = self._rank_cgroups.get(tracked.key)
            if cached is None or now - cached.checked_at >= CGROUP_RECHECK_SECONDS:
                try:
                    ref = self.cgroups.resolve(self.proc.cgroup(tracked.key.pid))
                except NoSuchProcess:
                    continue
                except ProbeError as exc:
                    self.problem = str(exc)
                    continue
                cached = self._rank_cgroups[tracked.key] = _RankCgroup(ref, now)
            if cached.ref is not None:
                refs[cached.ref.path] = cached.ref
                rank_cgroup[tracked.key] = cached.ref.path
        for path, ref in refs.items():
            self._recent[path] = (ref, now)
        for path, (ref, used) in list(self._recent.items()):
            if now - used > CGROUP_LINGER_SECONDS:
                del self._recent[path]
            else:
                refs.setdefault(path, ref)
        return refs, rank_cgroup

    def sample(
        self, ranks: list[TrackedRank], detail: bool = True
    ) -> tuple[tuple[CgroupSample, ...], dict[ProcKey, str]]:
        """The round's cgroup samples and each rank's cgroup path."""
        self.problem = None
        if not self.cgroups.available:
            return (), {}
        refs, rank_cgroup = self._refs(ranks)
        if not detail:
            light = self._usage_only(refs)
            if light is not None:
                return tuple(light.values()), rank_cgroup
        samples: dict[str, CgroupSample] = {}
        for path, ref in refs.items():
            _read, sample = self._read(path, self.cgroups.sample, ref)
            if sample is None:
                continue
            samples[path] = sample
            # Ancestors with a limit bind the job too: export their usage next to it.
            for level in sample.ancestors:
                if level.limit_bytes is not None and level.path not in samples and level.path not in refs:
                    try:
                        samples[level.path] = self.cgroups.sample_level(ref, level.path)
                    except ProbeError as exc:
                        self.problem = str(exc)
        self._last = samples
        return tuple(samples.values()), rank_cgroup

    def _usage_only(self, refs: dict[str, MemoryCgroupRef]) -> dict[str, CgroupSample] | None:
        """A light round: the usage, fresh; the rest as the last detailed round read it. None
        when a cgroup was not read in detail yet (then the round reads them all)."""
        last = self._last
        samples: dict[str, CgroupSample] = {}
        for path, ref in refs.items():
            prev = last.get(path)
            if prev is None:
                return None
            read, usage = self._read(path, self.cgroups.usage, ref)
            if not read:
                continue
            limit = prev.effective_limit_bytes
            if (
                usage is not None
                and prev.usage_bytes is not None
                and limit
                and usage - prev.usage_bytes > FAST_GROWTH_SHARE * limit
            ):
                # growing fast toward its limit: what fills it (memory.stat) is read now, so
                # the charge split a death would report is this round's, not a second old
                try:
                    prev = last[path] = self.cgroups.sample(ref)
                except ProbeError as exc:
                    self.problem = str(exc)
            samples[path] = _with_usage(prev, usage)
            for level in prev.ancestors:  # the limited ancestors read last time: their usage too
                above = last.get(level.path)
                if above is None or level.path in samples or level.path in refs:
                    continue
                try:
                    usage = self.cgroups.usage(self.cgroups.level_ref(ref, level.path))
                except ProbeError as exc:  # gone too, or unreadable: as last read
                    self.problem = str(exc)
                    usage = None
                samples[level.path] = _with_usage(above, usage)
        return samples
