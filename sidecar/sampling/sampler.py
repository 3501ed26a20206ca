"""One sampling round: discovery, then every probe (proc, cgroup, GPU, host), into one
immutable ``Snapshot``. ``Sampler.sample()`` is what the daemon's thread calls on its
deadlines (``daemon.py``); it never starts a subprocess and never waits on HTTP. Every
probe reports its success and duration; one that fails logs once per distinct problem and
the others go on.

Each file is read at the rate it matters. Every round: each rank's ``stat`` (CPU, RSS,
state) and its descendants' RSS (through descriptors held open), each cgroup's usage,
each GPU's memory. Once every ``DETAIL_SECONDS``, and every round while memory is near
a limit (the round's plan says so): the ranks' ``status`` (peak, anonymous and
shared memory, namespaces), the cgroups' other files (limits, memory.stat, events, PSI),
the host's, and NVML's per-process queries (memory and activity of each process). A round without
them carries the last detailed round's values and says so (``Snapshot.detail``).

The round's parts live beside it: each rank's reads (``ranks.py``), the cgroups
(``cgroups.py``), the GPUs' processes put on ranks (``gpus.py``) and the snapshot put
together (``assemble.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar import lognames, saferead
from sidecar.errors import ProbeError
from sidecar.model import HostSample, ProbeStatus, ProcKey, Snapshot
from sidecar.model.events import ExitEvent
from sidecar.probes.cgroup import CgroupReader
from sidecar.probes.gpu import GpuProbe
from sidecar.probes.host import HostReader
from sidecar.probes.proc import ProcReader
from sidecar.probes.pss import PssSampler
from sidecar.sampling.assemble import RankRows, carry_forecasts, job_samples
from sidecar.sampling.cgroups import CGROUP_LINGER_SECONDS, CgroupRounds
from sidecar.sampling.discovery import Discovery
from sidecar.sampling.gpus import GpuAttribution
from sidecar.sampling.jobs import TrackedJob
from sidecar.sampling.ranks import RankReader
from sidecar.settings import Settings

__all__ = ["CGROUP_LINGER_SECONDS", "PROBES", "RoundPlan", "Sampler"]

log = logging.getLogger(lognames.DAEMON)


DETAIL_SECONDS = 1.0
PROBES = ("discovery", "proc", "cgroup", "gpu", "host")


def _boot_time(proc_root: str) -> float | None:
    try:
        with open(f"{proc_root}/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """What the daemon tells the sampler of the round it asks for: nothing else reaches into
    the sampler. ``pressure``: memory is near a limit, so every file is read, every round.
    ``judged``: the last snapshot as published (with foresight's and the stall tracker's
    word), which a round between two detailed ones carries. ``overruns_total``: the rounds
    the schedule missed so far, reported on the snapshot."""

    pressure: bool = False
    judged: Snapshot | None = None
    overruns_total: int = 0


class _OnceLog:
    """Logs each distinct (probe, message) once, and again only after it cleared."""

    def __init__(self) -> None:
        self.active: dict[str, str] = {}

    def problem(self, probe: str, message: str, level: int = logging.WARNING) -> None:
        if self.active.get(probe) != message:
            self.active[probe] = message
            log.log(level, "probe=%s %s", probe, message)

    def clear(self, probe: str) -> None:
        if self.active.pop(probe, None) is not None:
            log.info("probe=%s recovered", probe)


class Sampler:
    """One sampling round: ``sample()`` returns a Snapshot. Owned by one thread."""

    def __init__(
        self,
        settings: Settings,
        *,
        gpu: GpuProbe | None = None,
        cgroups: CgroupReader | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.wall = wall
        self.proc = ProcReader(settings.proc_root)
        self.pss = PssSampler(self.proc.smaps_rollup, clock=clock)
        self.discovery = Discovery(
            self.proc,
            settings.pids,
            clock=clock,
            wall=wall,
            boot_time=_boot_time(settings.proc_root),
            marker=settings.run_marker,
        )
        self.cgroups = cgroups if cgroups is not None else CgroupReader.for_host(settings.proc_root)
        self.host = HostReader(settings.proc_root, settings.shm_path)
        self._gpu_off = "nvml" in settings.disabled  # --disable nvml: no probe, no series
        self.gpu = gpu if gpu is not None else GpuProbe(off=self._gpu_off)
        self.ranks = RankReader(self.proc, self.discovery, self.pss, smaps="smaps" not in settings.disabled)
        self.cgroup_rounds = CgroupRounds(self.cgroups, self.proc, clock)
        self.gpu_attribution = GpuAttribution(settings.proc_root)
        self._once = _OnceLog()
        self._detail_at: float | None = None
        self._shm: dict[str, tuple[int, int, float]] = {}  # job key -> its /dev/shm, last detailed round
        self._host: HostSample | None = None
        self.samples_total = 0
        if not self.cgroups.available:
            self._once.problem(
                "cgroup", "no memory cgroup hierarchy is mounted: no cgroup data", logging.INFO
            )

    @property
    def on_zombie(self) -> Callable[[ExitEvent], None] | None:
        """Called with a rank's zombie exit status: the fallback when the process connector
        is unavailable (the agent reaps within 0.1 s, so this sees a death only by luck)."""
        return self.ranks.on_zombie

    @on_zombie.setter
    def on_zombie(self, hook: Callable[[ExitEvent], None] | None) -> None:
        self.ranks.on_zombie = hook

    def _timed(
        self, probe: str, statuses: dict[str, ProbeStatus], start: float, ok: bool, message: str | None
    ) -> None:
        statuses[probe] = ProbeStatus(ok, self.clock() - start, message)
        if ok:
            self._once.clear(probe)
        elif message:
            self._once.problem(probe, message, logging.INFO if probe == "gpu" else logging.WARNING)

    def _read_shm(self, jobs: list[TrackedJob]) -> None:
        """Each job's /dev/shm in its own mount namespace (a container's, a private tmpfs),
        through its agent or a rank: kept so a death whose job is gone before the autopsy
        reads it still knows the size (a bus error's first question)."""
        keep: dict[str, tuple[int, int, float]] = {}
        for job in jobs:
            for pid in [job.agent.pid, *sorted(job.ranks)]:
                try:
                    st = saferead.statvfs_in_root(self.settings.proc_root, pid, "/dev/shm")
                except (OSError, saferead.Refused):
                    continue
                keep[job.key or ""] = (
                    st.f_blocks * st.f_frsize,
                    (st.f_blocks - st.f_bfree) * st.f_frsize,
                    self.clock(),
                )
                break
        self._shm = keep

    def _read_ranks(self, jobs: list[TrackedJob], detail: bool) -> tuple[RankRows, str | None]:
        """Every tracked rank's reads, by job; and the round's proc problem, if any."""
        rank_rows: RankRows = []
        problem: str | None = None

        def limit_used(key: ProcKey) -> int | None:
            return self.cgroup_rounds.limit_used(key, self._host)

        for job in jobs:
            if job.key is None:
                continue
            rows = []
            for pid, tracked in sorted(
                job.ranks.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, kv[0])
            ):
                try:
                    read = self.ranks.read(pid, tracked, detail, limit_used)
                except ProbeError as exc:
                    problem = str(exc)
                    continue
                if read is not None:
                    rows.append((tracked, read))
            rank_rows.append((job, rows))
        self.ranks.keep_only({tracked.key for _, rows in rank_rows for tracked, _ in rows})
        self.proc.keep_only({pid for _, rows in rank_rows for _, read in rows for pid in read.tree})
        return rank_rows, problem

    def sample(self, plan: RoundPlan = RoundPlan()) -> Snapshot:
        started = self.clock()
        statuses: dict[str, ProbeStatus] = {}
        # a round that starts a little early on the grid still counts as a second later
        detail = plan.pressure or self._detail_at is None or started - self._detail_at >= 0.9 * DETAIL_SECONDS
        if detail:
            self._detail_at = started

        t = self.clock()
        try:
            jobs = self.discovery.tick()
            self._timed("discovery", statuses, t, True, None)
        except Exception as exc:
            log.exception("probe=discovery failed")
            jobs = list(self.discovery.jobs.values())
            self._timed("discovery", statuses, t, False, f"discovery failed: {exc}")

        t = self.clock()
        rank_rows, proc_problem = self._read_ranks(jobs, detail)
        self._timed("proc", statuses, t, proc_problem is None, proc_problem)

        t = self.clock()
        cgroups = self.cgroup_rounds
        cgroup_samples, rank_cgroup = cgroups.sample(
            [tracked for _, rows in rank_rows for tracked, _ in rows], detail
        )
        if self.cgroups.available:
            self.cgroups.end_round()
        self._timed(
            "cgroup",
            statuses,
            t,
            self.cgroups.available and not cgroups.problem,
            cgroups.problem or (None if self.cgroups.available else "no memory cgroup hierarchy"),
        )

        t = self.clock()
        try:
            gpu_result = self.gpu.sample(detail)
            gpus, gpu_ok, gpu_msg = gpu_result.devices, gpu_result.success, gpu_result.message
        except Exception as exc:
            log.exception("probe=gpu failed")
            gpus, gpu_ok, gpu_msg = (), False, f"NVML failed: {exc}"
        if not self._gpu_off:
            self._timed("gpu", statuses, t, gpu_ok, gpu_msg)

        t = self.clock()
        host: HostSample | None = self._host
        if detail or host is None:
            try:
                host = self._host = self.host.sample()
                self._timed("host", statuses, t, True, None)
            except ProbeError as exc:
                host = self._host = None
                self._timed("host", statuses, t, False, str(exc))
        else:
            statuses["host"] = ProbeStatus(True, 0.0, None)

        gpu_by_rank, unmatched, gpu_activity = self.gpu_attribution.attribute(
            gpus, ((tracked.key, read) for _, rows in rank_rows for tracked, read in rows)
        )
        # A round between two detailed ones judges nothing: it carries the last word of
        # foresight and the stall tracker (daemon.py), built in, not copied in afterwards.
        judged = None if detail else plan.judged
        cgroup_samples = carry_forecasts(cgroup_samples, judged)
        if detail:
            self._read_shm([job for job, _ in rank_rows])
        jobs_now = job_samples(rank_rows, rank_cgroup, gpu_by_rank, gpu_activity, judged, self._shm)
        self.samples_total += 1
        return Snapshot(
            taken_at=self.wall(),
            monotonic=self.clock(),
            jobs=tuple(jobs_now),
            host=host,
            gpus=gpus,
            cgroups=cgroup_samples,
            probes=statuses,
            samples_total=self.samples_total,
            overruns_total=plan.overruns_total,
            sample_duration_seconds=self.clock() - started,
            unreadable_processes=len(self.discovery.unreadable),
            nvml_unmatched_pids=unmatched,
            smaps_cpu_seconds=self.pss.cpu_seconds,
            detail=detail,
        )
