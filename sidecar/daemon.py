"""The wiring: a sampler thread that runs discovery and every probe on fixed deadlines,
and publishes one immutable ``Snapshot`` per round.

The sampler never waits on HTTP clients and a scrape never waits on the sampler: the
snapshot is swapped under a lock and only read afterwards. Every probe reports its
success and duration; one that fails logs once per distinct problem and the others go
on. Nothing here starts a subprocess or writes outside the postmortem directory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from sidecar.deaths import DeathWatch
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
)
from sidecar.postmortem import PostmortemStore
from sidecar.probes.cgroup import CgroupReader, MemoryCgroupRef
from sidecar.probes.gpu import GpuProbe
from sidecar.probes.host import HostReader
from sidecar.probes.proc import ProcReader
from sidecar.settings import PRESSURE_INTERVAL_SECONDS, Settings
from sidecar.stalls import StallTracker
from sidecar.timeline import Timeline
from sidecar.watch.exits import ExitEvent, ProcConnector
from sidecar.watch.kmsg import KmsgWatcher
from sidecar.watch.pidfds import PidfdWatcher
from sidecar.watch.signals import SignalWatcher

__all__ = ["Daemon", "Sampler"]

log = logging.getLogger(__name__)

CGROUP_RECHECK_SECONDS = 10.0
# A cgroup's series stay this long after its last rank left: the OOM kill that emptied it
# must reach a scrape as an increment of trainwatch_cgroup_oom_kills_total (the agent tears
# the other ranks down within a second, before a 5 s scrape sees the new count).
CGROUP_LINGER_SECONDS = 120.0
# Near a memory limit the last sample before an OOM kill should be close to the kill:
# the sampler runs every PRESSURE_INTERVAL_SECONDS (settings.py) while a rank's cgroup is at
# >= PRESSURE_SHARE of its limit or the host has less than 1 - PRESSURE_SHARE available.
PRESSURE_SHARE = 0.9


def under_pressure(snapshot: Snapshot) -> bool:
    """True when a watched rank's memory is close to the limit that would OOM it."""
    if not snapshot.jobs:
        return False
    host = snapshot.host
    if host is not None and host.available_bytes < (1 - PRESSURE_SHARE) * host.total_bytes:
        return True
    for cg in snapshot.cgroups:
        limit = cg.effective_limit_bytes
        if limit and cg.usage_bytes is not None and cg.usage_bytes >= PRESSURE_SHARE * limit:
            return True
    return False


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


def _rank_sample(
    job: TrackedJob,
    tracked: TrackedRank,
    read: _RankRead,
    rank_cgroup: dict[ProcKey, str],
    gpu_by_rank: dict[ProcKey, dict[int, int]],
) -> RankSample:
    return RankSample(
        job=job.key or "",
        rank=tracked.rank,
        rank_label=tracked.label,
        local_rank=tracked.local_rank,
        restart=tracked.restart,
        key=tracked.key,
        rss_bytes=read.rss_bytes,
        peak_rss_bytes=read.peak_rss_bytes,
        cpu_seconds=read.cpu_seconds,
        threads=read.threads,
        tree_rss_bytes=read.tree_rss_bytes,
        tree_processes=read.tree_processes,
        cgroup=rank_cgroup.get(tracked.key),
        gpu_memory_bytes=gpu_by_rank.get(tracked.key, {}),
        ns_pids=read.ns_pids,
        flight_recorder=tracked.env.flight_recorder if tracked.env else None,
        error_file=tracked.env.error_file if tracked.env else None,
    )


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

    def sample(self) -> Snapshot:
        started = self.clock()
        statuses: dict[str, ProbeStatus] = {}

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
                    row = self._sample_rank(job, pid, tracked)
                except ProbeError as exc:
                    proc_problem = str(exc)
                    continue
                if row is not None:
                    rows.append(row)
            rank_rows.append((job, rows))
        self._timed("proc", statuses, t, proc_problem is None, proc_problem)

        t = self.clock()
        cgroup_samples, rank_cgroup = self._sample_cgroups([r for _, rows in rank_rows for r in rows])
        self._timed(
            "cgroup",
            statuses,
            t,
            self.cgroups.available and not self._cgroup_problem,
            self._cgroup_problem or (None if self.cgroups.available else "no memory cgroup hierarchy"),
        )

        t = self.clock()
        try:
            gpu_result = self.gpu.sample()
            gpus, gpu_ok, gpu_msg = gpu_result.devices, gpu_result.success, gpu_result.message
        except Exception as exc:
            log.exception("probe=gpu failed")
            gpus, gpu_ok, gpu_msg = (), False, f"NVML failed: {exc}"
        self._timed("gpu", statuses, t, gpu_ok, gpu_msg)

        t = self.clock()
        host: HostSample | None
        try:
            host = self.host.sample()
            self._timed("host", statuses, t, True, None)
        except ProbeError as exc:
            host = None
            self._timed("host", statuses, t, False, str(exc))

        gpu_by_rank, unmatched = self._attribute_gpu(gpus, rank_rows)
        job_samples: list[JobSample] = []
        for job, rows in rank_rows:
            ranks = []
            for tracked, sample in rows:
                ranks.append(_rank_sample(job, tracked, sample, rank_cgroup, gpu_by_rank))
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
        )

    # -- per rank -----------------------------------------------------------------------

    def _sample_rank(
        self, job: TrackedJob, pid: int, tracked: TrackedRank
    ) -> tuple[TrackedRank, _RankRead] | None:
        proc, discovery = self.proc, self.discovery
        try:
            st = proc.stat(pid)
            if st.start_ticks != tracked.key.start_ticks:
                discovery.forget(pid)
                return None
            if st.state in ("Z", "X"):
                if self.on_zombie is not None and st.exit_code is not None:
                    self.on_zombie(ExitEvent(pid, st.exit_code, st.ppid, time.monotonic_ns(), source="proc"))
                return None  # dead, not yet reaped by the agent: no longer a live rank
            status = proc.status(pid)
        except NoSuchProcess:
            discovery.forget(pid)
            return None
        if status.rss_bytes is None:
            return None  # no address space any more: killed and exiting, not a live rank
        tree = discovery.trees.get(pid) or discovery.tree(pid)
        rss = status.rss_bytes
        tree_rss = rss
        members = 1
        entries = discovery.entries
        stat_brief = proc.stat_brief
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
        return tracked, _RankRead(
            rss, status.peak_rss_bytes, st.cpu_seconds, st.threads, tree_rss, members, tree, status.ns_pids
        )

    # -- cgroups ------------------------------------------------------------------------

    _cgroup_problem: str | None = None

    def _sample_cgroups(
        self, rows: list[tuple[TrackedRank, _RankRead]]
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
        for path, ref in refs.items():
            try:
                sample = self.cgroups.sample(ref)
            except NoSuchProcess:
                self._recent_cgroups.pop(path, None)
                continue
            except ProbeError as exc:
                self._cgroup_problem = str(exc)
                continue
            samples[path] = sample
            # Ancestors with a limit bind the job too: export their usage next to it.
            for level in sample.ancestors:
                if level.limit_bytes is not None and level.path not in samples and level.path not in refs:
                    try:
                        samples[level.path] = self.cgroups.sample_level(ref, level.path)
                    except ProbeError as exc:
                        self._cgroup_problem = str(exc)
        return tuple(samples.values()), rank_cgroup

    # -- GPU attribution ----------------------------------------------------------------

    def _attribute_gpu(
        self,
        gpus: tuple[GpuDeviceSample, ...],
        rank_rows: list[tuple[TrackedJob, list[tuple[TrackedRank, _RankRead]]]],
    ) -> tuple[dict[ProcKey, dict[int, int]], tuple[int, ...]]:
        if not gpus:
            return {}, ()
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
        for device in gpus:
            for proc in device.processes:
                key = owner.get(proc.pid)
                if key is None:
                    unmatched.append(proc.pid)
                    continue
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
        return result, tuple(unmatched)


class Daemon:
    """Owns the sampler thread, the latest snapshot, the timeline and the death watchers.

    ``watch_deaths=False`` leaves out the process connector and the kernel log reader
    (tests that sample fixture trees, whose pids are not this machine's)."""

    def __init__(
        self,
        settings: Settings,
        sampler: Sampler | None = None,
        *,
        watch_deaths: bool = True,
        job_output: Callable[[int], str] | None = None,
    ) -> None:
        self.settings = settings
        self.sampler = sampler if sampler is not None else Sampler(settings)
        self.timeline = Timeline(settings.history_seconds, settings.interval_seconds)
        self.store = PostmortemStore(settings.postmortem_dir)
        self.stalls = StallTracker(settings.stall_after_seconds, py_spy=settings.py_spy)
        host = HostReader(settings.proc_root)
        self.deaths = DeathWatch(
            self.store,
            self.timeline,
            read_host_oom_kills=host.oom_kills,
            read_cgroup_oom_kills=self.sampler.cgroups.oom_kills,
            read_oomd_marks=self.sampler.cgroups.oomd_marks,
            read_outputs="outputs" not in settings.disabled,
            proc_root=settings.proc_root,
            job_output=job_output,
            stacks_of=self.stalls.stacks,
        )
        self.watch_deaths = watch_deaths
        self.connector: ProcConnector | None = None
        self.kmsg: KmsgWatcher | None = None
        self.signals: SignalWatcher | None = None
        self.pidfds: PidfdWatcher | None = None
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_done: float | None = None

    @property
    def snapshot(self) -> Snapshot | None:
        with self._lock:
            return self._snapshot

    def start(self) -> None:
        if self._thread is not None:
            return
        if self.watch_deaths:
            self._start_watchers()
        self.deaths.start()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="trainwatch-sampler", daemon=True)
        self._thread.start()

    def _start_watchers(self) -> None:
        off = self.settings.disabled
        for source in sorted(off):
            log.info("%s: turned off by --disable", source)
        if "connector" not in off:
            connector = ProcConnector(
                self.deaths.on_exit, on_overrun=lambda: self.deaths.resync(self.settings.proc_root)
            )
            try:
                connector.start()
                self.connector = connector
                self.deaths.exits_first_hand = True
                log.info(
                    "exits: process connector subscribed (%s)",
                    "non-zero exits only" if connector.filtered else "all exits",
                )
            except OSError as exc:
                log.warning(
                    "exits: the process connector is not available (%s); run as root in the host's PID, "
                    "user and network namespaces to get exits first-hand from the kernel",
                    exc.strerror or exc,
                )
        if self.connector is None and "pidfd" not in off:
            pidfds = PidfdWatcher(self.deaths.on_exit, self.deaths.on_unknown, self.settings.proc_root)
            try:
                pidfds.start()
                self.pidfds = pidfds
                log.info(
                    "exits: watching each rank through a pidfd (exit statuses from zombies or the kernel)"
                )
            except OSError as exc:
                log.warning("exits: pidfds do not work here (%s)", exc.strerror or exc)
        if self.connector is None and self.pidfds is None:
            log.warning(
                "exits: neither the process connector nor pidfds: exit statuses come from zombies seen "
                "in /proc or the agent's log, and are often unknown"
            )
            self.sampler.discovery.on_gone = lambda key: self.deaths.on_unknown(key.pid, time.monotonic_ns())
            self.sampler.on_zombie = self.deaths.on_exit
        if "kmsg" not in off:
            kmsg = KmsgWatcher(self.deaths.on_kmsg)
            try:
                kmsg.start()
                self.kmsg = kmsg
                self.deaths.kernel_log_readable = True
                log.info("kernel log: reading /dev/kmsg for OOM records")
            except OSError as exc:
                log.warning(
                    "kernel log: /dev/kmsg is not readable (%s): OOM kills are told by counters only, "
                    "never 'certain'; run as root (or with CAP_SYSLOG) to read it",
                    exc.strerror or exc,
                )
        if "tracepoint" not in off:
            signals = SignalWatcher(self.deaths.on_signal)
            try:
                signals.start()
                self.signals = signals
                log.info("signals: signal:signal_generate tracepoint enabled in a private tracefs instance")
            except OSError as exc:
                log.info(
                    "signals: the signal tracepoint is not available (%s): the sender of a kill is not "
                    "known; mount tracefs (mount -t tracefs nodev /sys/kernel/tracing) and run as root "
                    "to name it",
                    exc.strerror or exc,
                )

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for watcher in (self.connector, self.kmsg, self.signals, self.pidfds):
            if watcher is not None:
                watcher.stop()
        self.connector = self.kmsg = self.signals = self.pidfds = None
        self.deaths.stop()  # finishes any postmortem in flight
        self.sampler.gpu.close()

    def healthy(self) -> tuple[bool, str]:
        """(ok, why): the sampler thread is alive and finished a round recently."""
        if self._thread is None or not self._thread.is_alive():
            return False, "sampler not running"
        if self._last_done is None:
            return False, "no sample yet"
        age = time.monotonic() - self._last_done
        if age > self.settings.stall_seconds:
            return False, f"sampler stalled: last sample {age:.1f}s ago"
        return True, "ok"

    def sample_now(self) -> Snapshot:
        """Run one round on the caller's thread and publish it (tests, one-shot use)."""
        snapshot = self.sampler.sample()
        self._publish(snapshot)
        return snapshot

    def _publish(self, snapshot: Snapshot) -> None:
        stalled = self.stalls.update(snapshot)
        if any(stalled.values()):
            snapshot = dataclasses.replace(
                snapshot,
                jobs=tuple(
                    dataclasses.replace(j, stalled_seconds=round(stalled.get(j.key, 0.0), 3))
                    for j in snapshot.jobs
                ),
            )
        with self._lock:
            self._snapshot = snapshot
        self._last_done = time.monotonic()
        self.timeline.record(snapshot)
        self.deaths.observe(snapshot)
        if self.pidfds is not None:
            for job in snapshot.jobs:
                if job.agent_alive:
                    self.pidfds.track(job.agent.pid, job.agent.start_ticks)
                for rank in job.ranks:
                    self.pidfds.track(rank.key.pid, rank.key.start_ticks)

    def _run(self) -> None:
        base = self.settings.interval_seconds
        interval = base
        clock = self.sampler.clock
        deadline = clock()
        while not self._stop.is_set():
            snapshot = None
            try:
                snapshot = self.sampler.sample()
                self._publish(snapshot)
            except Exception:
                log.exception("sampling round failed")
            fast = snapshot is not None and under_pressure(snapshot)
            if fast != (interval < base):
                if fast:
                    log.info(
                        "memory is near a limit: sampling every %gs until it is not",
                        PRESSURE_INTERVAL_SECONDS,
                    )
                else:
                    log.info("memory pressure is over: back to sampling every %gs", base)
            interval = min(base, PRESSURE_INTERVAL_SECONDS) if fast else base
            deadline += interval
            now = clock()
            if now > deadline:
                missed = int((now - deadline) // interval) + 1
                self.sampler.overruns_total += missed
                deadline += missed * interval
            self._stop.wait(max(0.0, deadline - now))
