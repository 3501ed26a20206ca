"""One sampling round: discovery, then every probe (proc, cgroup, GPU, host), into one
immutable ``Snapshot``. ``Sampler.sample()`` is what the daemon's thread calls on its
deadlines (``daemon.py``); it never starts a subprocess and never waits on HTTP. Every
probe reports its success and duration; one that fails logs once per distinct problem and
the others go on.

Each file is read at the rate it matters. Every round: each rank's ``stat`` (CPU, RSS,
state) and its descendants' RSS (through descriptors held open), each cgroup's usage,
each GPU's memory. Once every ``DETAIL_SECONDS``, and every round while memory is near
a limit (``pressure``, set by the daemon): the ranks' ``status`` (peak, anonymous and
shared memory, namespaces), the cgroups' other files (limits, memory.stat, events, PSI),
the host's, and NVML's per-process queries (memory and activity of each process). A round without
them carries the last detailed round's values and says so (``Snapshot.detail``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from sidecar import saferead
from sidecar.discovery import Discovery, TrackedJob, TrackedRank
from sidecar.errors import NoSuchProcess, ProbeError
from sidecar.model import (
    CgroupSample,
    GpuDeviceSample,
    HostSample,
    JobSample,
    ProbeStatus,
    ProcKey,
    RankSample,
    Snapshot,
    evolve,
)
from sidecar.probes.cgroup import CgroupReader, MemoryCgroupRef
from sidecar.probes.gpu import GpuProbe
from sidecar.probes.host import HostReader
from sidecar.probes.proc import ProcReader, ProcStat, ProcStatus
from sidecar.probes.pss import PssSampler
from sidecar.settings import Settings
from sidecar.watch.exits import ExitEvent

__all__ = ["CGROUP_LINGER_SECONDS", "PROBES", "Sampler"]

_V = TypeVar("_V")

log = logging.getLogger("sidecar.daemon")  # the sampler's problems, as before the split


CGROUP_RECHECK_SECONDS = 10.0
DETAIL_SECONDS = 1.0
# A cgroup whose usage grew by this share of its limit since its last full read is read in
# full that round, detailed or not
FAST_GROWTH_SHARE = 0.05
# A cgroup's series stay this long after its last rank left: the OOM kill that emptied it
# must reach a scrape as an increment of trainwatch_cgroup_oom_kills_total (the agent tears
# the other ranks down within a second, before a 5 s scrape sees the new count).
CGROUP_LINGER_SECONDS = 120.0
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


class _RankRead(NamedTuple):
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


def _rank_sample(
    job: TrackedJob,
    tracked: TrackedRank,
    read: _RankRead,
    rank_cgroup: dict[ProcKey, str],
    gpu_by_rank: dict[ProcKey, dict[int, int]],
    gpu_activity: dict[ProcKey, tuple[float, float]],
    judged: RankSample | None = None,
) -> RankSample:
    """``judged``: the rank as last published, whose foresight and stall judgements a
    round between two detailed ones carries."""
    sm, mem = gpu_activity.get(tracked.key, (None, None))
    return RankSample(
        job=job.key or "",
        rank=tracked.rank,
        rank_label=tracked.label,
        local_rank=tracked.local_rank,
        restart=tracked.restart,
        key=tracked.key,
        rss_bytes=read.rss_bytes,
        # VmHWM is the detailed round's, RSS may be a later statm: the mark is at least it
        peak_rss_bytes=None if read.peak_rss_bytes is None else max(read.peak_rss_bytes, read.rss_bytes),
        cpu_seconds=read.cpu_seconds,
        threads=read.threads,
        tree_rss_bytes=read.tree_rss_bytes,
        tree_processes=read.tree_processes,
        cgroup=rank_cgroup.get(tracked.key),
        gpu_memory_bytes=gpu_by_rank.get(tracked.key, {}),
        ns_pids=read.ns_pids,
        flight_recorder=tracked.env.flight_recorder if tracked.env else None,
        error_file=tracked.env.error_file if tracked.env else None,
        run_output=tracked.env.run_output if tracked.env else None,
        uid=read.uid,
        tree_pss_bytes=read.tree_pss_bytes,
        tree_uss_bytes=read.tree_uss_bytes,
        tree_unreclaimable_bytes=read.tree_unreclaimable_bytes,
        workers_uss=read.workers_uss,
        flight_pipe=tracked.env.flight_pipe if tracked.env else None,
        slurm_times=tracked.env.slurm_times if tracked.env else None,
        gpu_sm_percent=sm,
        gpu_memory_percent=mem,
        binding_limit=None if judged is None else judged.binding_limit,
        exhaustion_seconds=None if judged is None else judged.exhaustion_seconds,
        progress=None if judged is None else judged.progress,
    )


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
            self.proc, settings.pids, clock=clock, wall=wall, boot_time=_boot_time(settings.proc_root)
        )
        self.cgroups = cgroups if cgroups is not None else CgroupReader.for_host(settings.proc_root)
        self.host = HostReader(settings.proc_root, settings.shm_path)
        self.gpu = gpu if gpu is not None else GpuProbe()
        self._rank_cgroups: dict[ProcKey, _RankCgroup] = {}
        self._recent_cgroups: dict[str, tuple[MemoryCgroupRef, float]] = {}  # path -> (ref, last used)
        self._once = _OnceLog()
        self._nvml_ns_warned = False
        self.pressure = False  # memory near a limit: every file, every round (the daemon sets it)
        self._detail_at: float | None = None
        self._statuses: dict[ProcKey, ProcStatus] = {}  # the last detailed round's
        self._stats: dict[ProcKey, ProcStat] = {}  # likewise (CPU time, threads)
        self._cgroup_samples: dict[str, CgroupSample] = {}  # path -> the last detailed sample
        self._shm: dict[str, tuple[int, int, float]] = {}  # job key -> its /dev/shm, last detailed round
        self._host: HostSample | None = None
        # The last snapshot as published (with foresight's and the stall tracker's word),
        # set by the daemon: what a round between two detailed ones carries.
        self.judged: Snapshot | None = None
        # Called with a rank's zombie exit status: the fallback when the process connector
        # is unavailable (the agent reaps within 0.1 s, so this sees a death only by luck).
        self.on_zombie: Callable[[ExitEvent], None] | None = None
        self.samples_total = 0
        self.overruns_total = 0
        if not self.cgroups.available:
            self._once.problem(
                "cgroup", "no memory cgroup hierarchy is mounted: no cgroup data", logging.INFO
            )

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

    def sample(self) -> Snapshot:
        started = self.clock()
        statuses: dict[str, ProbeStatus] = {}
        # a round that starts a little early on the grid still counts as a second later
        detail = self.pressure or self._detail_at is None or started - self._detail_at >= 0.9 * DETAIL_SECONDS
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
        rank_rows: list[tuple[TrackedJob, list[tuple[TrackedRank, _RankRead]]]] = []
        proc_problem: str | None = None
        for job in jobs:
            if job.key is None:
                continue
            rows = []
            for pid, tracked in sorted(
                job.ranks.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, kv[0])
            ):
                try:
                    row = self._sample_rank(job, pid, tracked, detail)
                except ProbeError as exc:
                    proc_problem = str(exc)
                    continue
                if row is not None:
                    rows.append(row)
            rank_rows.append((job, rows))
        live = {tracked.key for _, rows in rank_rows for tracked, _ in rows}
        self.pss.forget(live)
        for key in [k for k in self._statuses if k not in live]:
            del self._statuses[key]
        for key in [k for k in self._stats if k not in live]:
            del self._stats[key]
        self.proc.keep_only({pid for _, rows in rank_rows for _, read in rows for pid in read.tree})
        self._timed("proc", statuses, t, proc_problem is None, proc_problem)

        t = self.clock()
        cgroup_samples, rank_cgroup = self._sample_cgroups([r for _, rows in rank_rows for r in rows], detail)
        if self.cgroups.available:
            self.cgroups.end_round()
        self._timed(
            "cgroup",
            statuses,
            t,
            self.cgroups.available and not self._cgroup_problem,
            self._cgroup_problem or (None if self.cgroups.available else "no memory cgroup hierarchy"),
        )

        t = self.clock()
        try:
            gpu_result = self.gpu.sample(detail)
            gpus, gpu_ok, gpu_msg = gpu_result.devices, gpu_result.success, gpu_result.message
        except Exception as exc:
            log.exception("probe=gpu failed")
            gpus, gpu_ok, gpu_msg = (), False, f"NVML failed: {exc}"
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

        gpu_by_rank, unmatched, gpu_activity = self._attribute_gpu(gpus, rank_rows)
        # A round between two detailed ones judges nothing: it carries the last word of
        # foresight and the stall tracker (daemon.py), built in, not copied in afterwards.
        judged = None if detail else self.judged
        judged_ranks = {} if judged is None else {r.key: r for j in judged.jobs for r in j.ranks}
        judged_jobs = {} if judged is None else {j.key: j for j in judged.jobs}
        if judged is not None:
            forecast = {
                c.path: c.exhaustion_seconds for c in judged.cgroups if c.exhaustion_seconds is not None
            }
            if forecast:
                cgroup_samples = tuple(
                    c if c.path not in forecast else evolve(c, exhaustion_seconds=forecast[c.path])
                    for c in cgroup_samples
                )
        if detail:
            self._read_shm([job for job, _ in rank_rows])
        job_samples: list[JobSample] = []
        for job, rows in rank_rows:
            ranks = []
            for tracked, sample in rows:
                ranks.append(
                    _rank_sample(
                        job,
                        tracked,
                        sample,
                        rank_cgroup,
                        gpu_by_rank,
                        gpu_activity,
                        judged_ranks.get(tracked.key),
                    )
                )
            was = judged_jobs.get(job.key or "")
            job_samples.append(
                JobSample(
                    key=job.key or "",
                    agent=job.agent,
                    run_id=job.run_id,
                    world_size=job.world_size,
                    restart_count=job.restart_count,
                    max_restarts=job.max_restarts,
                    entrypoint=job.entrypoint,
                    started_at=job.started_at,
                    ranks=tuple(ranks),
                    agent_alive=job.agent_alive,
                    stalled_seconds=0.0 if was is None else was.stalled_seconds,
                    suspected_missing=() if was is None else was.suspected_missing,
                    shm=self._shm.get(job.key or ""),
                )
            )
        self.samples_total += 1
        return Snapshot(
            taken_at=self.wall(),
            monotonic=self.clock(),
            jobs=tuple(job_samples),
            host=host,
            gpus=gpus,
            cgroups=cgroup_samples,
            probes=statuses,
            samples_total=self.samples_total,
            overruns_total=self.overruns_total,
            sample_duration_seconds=self.clock() - started,
            unreadable_processes=len(self.discovery.unreadable),
            nvml_unmatched_pids=unmatched,
            smaps_cpu_seconds=self.pss.cpu_seconds,
            detail=detail,
        )

    # -- per rank -----------------------------------------------------------------------

    def _sample_rank(
        self, job: TrackedJob, pid: int, tracked: TrackedRank, detail: bool = True
    ) -> tuple[TrackedRank, _RankRead] | None:
        proc, discovery = self.proc, self.discovery
        key = tracked.key
        light = not detail and self.on_zombie is None and discovery.feed is not None and proc.keeps
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
                    if self.on_zombie is not None and st.exit_code is not None:
                        now_ns = time.monotonic_ns()
                        self.on_zombie(ExitEvent(pid, st.exit_code, st.ppid, now_ns, source="proc"))
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
        tree = discovery.trees.get(pid) or discovery.tree(pid)
        tree_rss = rss
        members = 1
        entries = discovery.entries
        if discovery.feed is not None and proc.keeps:
            # The connector tells discovery of every exit and fork in the tree, and a held
            # descriptor cannot read another process: statm's RSS is all a round needs.
            def same(child: int) -> bool:  # before a child's descriptor is first opened
                entry = entries.get(child)
                try:
                    return entry is not None and proc.stat(child).start_ticks == entry.key.start_ticks
                except NoSuchProcess:
                    return False  # (another ProbeError skips the child this round)

            children = [child for child in tree[1:] if child in entries]
            if children:
                rss_sum, alive, gone = proc.rss_kept_sum(children, same)
                tree_rss += rss_sum
                members += alive
                for child in gone:  # exited, or the pid is another process's already
                    discovery.forget(child)
        else:
            tree_rss, members = self._tree_by_stat(tree, tree_rss, members)
        pss: int | None = None
        uss: int | None = None
        workers: tuple[tuple[int, int, int], ...] = ()
        if "smaps" not in self.settings.disabled:
            if detail:  # due every 30 s, sooner on growth: asked once a second
                pss, uss, workers = self.pss.of(tracked.key, tree, tree_rss, self._limit_used(tracked.key))
            else:
                pss, uss, workers = self.pss.last(tracked.key)
        return tracked, _RankRead(
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

    def _tree_by_stat(self, tree: list[int], tree_rss: int, members: int) -> tuple[int, int]:
        """The descendants' RSS from their stat, checking each is still the process
        discovery saw (start time) and where (parent): without the connector, nothing
        else tells."""
        discovery = self.discovery
        entries = discovery.entries
        stat_brief = self.proc.stat_brief_kept
        for child in tree[1:]:
            entry = entries.get(child)
            if entry is None:
                continue
            try:
                state, ppid, start_ticks, child_rss = stat_brief(child)
            except NoSuchProcess:
                discovery.forget(child)
                continue
            except ProbeError:
                continue
            if start_ticks != entry.key.start_ticks:
                discovery.forget(child)
                continue
            if ppid != entry.ppid:
                discovery.reparent(child, ppid)
            if state in ("Z", "X"):
                continue
            tree_rss += child_rss
            members += 1
        return tree_rss, members

    def _cgroup_read(
        self, path: str, read: Callable[[MemoryCgroupRef], _V], ref: MemoryCgroupRef
    ) -> tuple[bool, _V | None]:
        """(True, what ``read`` gave), or (False, None) when the cgroup is gone (no longer
        lingered over) or unreadable (the round's cgroup problem)."""
        try:
            return True, read(ref)
        except NoSuchProcess:
            self._recent_cgroups.pop(path, None)
        except ProbeError as exc:
            self._cgroup_problem = str(exc)
        return False, None

    def _limit_used(self, key: ProcKey) -> int | None:
        """What the limit a rank lives under held at the last round: its cgroup's usage, else
        the host's memory in use (None before either was read)."""
        cached = self._rank_cgroups.get(key)
        if cached is not None and cached.ref is not None:
            sample = self._cgroup_samples.get(cached.ref.path)
            if sample is not None and sample.usage_bytes is not None:
                return sample.usage_bytes
        host = self._host
        return None if host is None else host.total_bytes - host.available_bytes

    # -- cgroups ------------------------------------------------------------------------

    _cgroup_problem: str | None = None

    def _sample_cgroups(
        self, rows: list[tuple[TrackedRank, _RankRead]], detail: bool = True
    ) -> tuple[tuple[CgroupSample, ...], dict[ProcKey, str]]:
        self._cgroup_problem = None
        if not self.cgroups.available:
            return (), {}
        now = self.clock()
        live = {tracked.key for tracked, _ in rows}
        for key in [k for k in self._rank_cgroups if k not in live]:
            del self._rank_cgroups[key]
        refs: dict[str, MemoryCgroupRef] = {}
        rank_cgroup: dict[ProcKey, str] = {}
        for tracked, _ in rows:
            cached = self._rank_cgroups.get(tracked.key)
            if cached is None or now - cached.checked_at >= CGROUP_RECHECK_SECONDS:
                try:
                    ref = self.cgroups.resolve(self.proc.cgroup(tracked.key.pid))
                except NoSuchProcess:
                    continue
                except ProbeError as exc:
                    self._cgroup_problem = str(exc)
                    continue
                cached = self._rank_cgroups[tracked.key] = _RankCgroup(ref, now)
            if cached.ref is not None:
                refs[cached.ref.path] = cached.ref
                rank_cgroup[tracked.key] = cached.ref.path
        for path, ref in refs.items():
            self._recent_cgroups[path] = (ref, now)
        for path, (ref, used) in list(self._recent_cgroups.items()):
            if now - used > CGROUP_LINGER_SECONDS:
                del self._recent_cgroups[path]
            else:
                refs.setdefault(path, ref)
        samples: dict[str, CgroupSample] = {}
        last = self._cgroup_samples
        if not detail:  # the usage, fresh; the rest as the last detailed round read it
            for path, ref in refs.items():
                prev = last.get(path)
                if prev is None:
                    detail = True  # a cgroup not read in detail yet: read them all
                    break
                read, usage = self._cgroup_read(path, self.cgroups.usage, ref)
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
                        self._cgroup_problem = str(exc)
                samples[path] = _with_usage(prev, usage)
                for level in prev.ancestors:  # the limited ancestors read last time: their usage too
                    above = last.get(level.path)
                    if above is None or level.path in samples or level.path in refs:
                        continue
                    try:
                        usage = self.cgroups.usage(self.cgroups.level_ref(ref, level.path))
                    except ProbeError as exc:  # gone too, or unreadable: as last read
                        self._cgroup_problem = str(exc)
                        usage = None
                    samples[level.path] = _with_usage(above, usage)
            if not detail:
                return tuple(samples.values()), rank_cgroup
            samples = {}
        for path, ref in refs.items():
            _read, sample = self._cgroup_read(path, self.cgroups.sample, ref)
            if sample is None:
                continue
            samples[path] = sample
            # Ancestors with a limit bind the job too: export their usage next to it.
            for level in sample.ancestors:
                if level.limit_bytes is not None and level.path not in samples and level.path not in refs:
                    try:
                        samples[level.path] = self.cgroups.sample_level(ref, level.path)
                    except ProbeError as exc:
                        self._cgroup_problem = str(exc)
        self._cgroup_samples = samples
        return tuple(samples.values()), rank_cgroup

    # -- GPU attribution ----------------------------------------------------------------

    def _attribute_gpu(
        self,
        gpus: tuple[GpuDeviceSample, ...],
        rank_rows: list[tuple[TrackedJob, list[tuple[TrackedRank, _RankRead]]]],
    ) -> tuple[dict[ProcKey, dict[int, int]], tuple[int, ...], dict[ProcKey, tuple[float, float]]]:
        """Per rank: GPU memory by device; NVML pids that are no rank's; and its tree's
        activity, the busiest (SM %, memory %) of its processes on any GPU."""
        if not gpus:
            return {}, (), {}
        owner: dict[int, ProcKey] = {}
        for _, rows in rank_rows:
            for tracked, read in rows:
                for pid in read.tree:
                    owner[pid] = tracked.key
                # NVML reports host pids; NSpid lists the rank's pid in every namespace
                # this /proc can see, so a daemon whose /proc is the host's still matches
                # ranks that run in containers, and log lines with container pids map back.
                for ns_pid in read.ns_pids:
                    owner.setdefault(ns_pid, tracked.key)
        result: dict[ProcKey, dict[int, int]] = {}
        unmatched: list[int] = []
        activity: dict[ProcKey, tuple[float, float]] = {}
        for device in gpus:
            for proc in device.processes:
                key = owner.get(proc.pid)
                if key is None:
                    unmatched.append(proc.pid)
                    continue
                if proc.sm_percent is not None:
                    sm, mem = activity.get(key, (0.0, 0.0))
                    activity[key] = (max(sm, proc.sm_percent), max(mem, proc.memory_percent or 0.0))
                if proc.used_bytes is None:
                    continue
                per_gpu = result.setdefault(key, {})
                per_gpu[device.index] = per_gpu.get(device.index, 0) + proc.used_bytes
        if unmatched and owner and not self._nvml_ns_warned:
            foreign = [p for p in unmatched if not os.path.exists(f"{self.settings.proc_root}/{p}")]
            if foreign:
                self._nvml_ns_warned = True
                log.warning(
                    "probe=gpu NVML lists pids %s that do not exist in %s: trainwatch runs in "
                    "another PID namespace than the GPU processes (NVML reports host pids). Run it "
                    "in the host PID namespace (docker --pid=host, Kubernetes hostPID: true) to "
                    "attribute GPU memory to ranks",
                    foreign[:5],
                    self.settings.proc_root,
                )
        return result, tuple(unmatched), activity
