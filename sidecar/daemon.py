"""The wiring and the schedule: a thread runs the sampling round (``sampling/sampler.py``) on fixed
deadlines (every 0.1 s near a memory limit), publishes one immutable ``Snapshot`` per
round, and starts the watchers that feed the death watch.

The sampler never waits on HTTP clients and a scrape never waits on the sampler: the
snapshot is swapped under a lock and only read afterwards. Nothing here starts a
subprocess or writes outside the postmortem directory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sidecar import lognames, protection, saferead
from sidecar.deaths.engine import DeathWatch, Sources
from sidecar.deaths.gather import Gatherer
from sidecar.deaths.journal import Journal, read_boot_id
from sidecar.deaths.saved import SavedState
from sidecar.model import Snapshot
from sidecar.postmortem import PostmortemStore
from sidecar.probes.host import HostReader
from sidecar.probes.proc import TICKS_PER_SECOND
from sidecar.probes.zombies import ask_zombie_status
from sidecar.sampling.foresight import Foresight
from sidecar.sampling.sampler import CGROUP_LINGER_SECONDS, RoundPlan, Sampler
from sidecar.sampling.timeline import Timeline
from sidecar.settings import PRESSURE_INTERVAL_SECONDS, Settings
from sidecar.stalls.stranded import StrandTracker
from sidecar.stalls.tracker import StallTracker
from sidecar.watch.exits import ProcConnector
from sidecar.watch.kmsg import KmsgWatcher
from sidecar.watch.pidfds import PidfdWatcher
from sidecar.watch.signals import SignalWatcher

__all__ = ["CGROUP_LINGER_SECONDS", "Daemon", "Sampler", "under_pressure"]

log = logging.getLogger(lognames.DAEMON)

# Near a memory limit the last sample before an OOM kill should be close to the kill:
# the sampler runs every PRESSURE_INTERVAL_SECONDS (settings.py) while a rank's cgroup is at
# >= PRESSURE_SHARE of its limit or the host has less than 1 - PRESSURE_SHARE available.
PRESSURE_SHARE = 0.9
# With no job to watch and the connector telling when one starts, the sampler wakes this
# often (a rescan of /proc for launchers that never name themselves pt_elastic, DeepSpeed's
# among them, and the host's figures): an idle daemon costs almost nothing (a listing of
# /proc and the stat of new pids: 0.105 % of a core here, against 0.024 % when it slept
# 10 s and found such launchers late; benchmarks/results/overhead-ab-rescan.json).
IDLE_INTERVAL_SECONDS = 1.0


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
        self.stalls = StallTracker(
            settings.stall_after_seconds, py_spy=settings.py_spy, proc_root=settings.proc_root
        )
        self.foresight = Foresight()
        cgroups = self.sampler.cgroups
        gather = Gatherer(  # the one door to a dead job's files and the counters
            proc_root=settings.proc_root,
            read_outputs="outputs" not in settings.disabled,
            job_output=job_output,
            read_host_oom_kills=HostReader(settings.proc_root).oom_kills,
            read_cgroup_oom_kills=cgroups.oom_kills,
            read_cgroup_limit_hits=cgroups.limit_hits,
            read_oomd_marks=cgroups.oomd_marks,
        )
        self.deaths = DeathWatch(
            self.store,
            self.timeline,
            gather,
            stall_of=self.stalls.stall,
            warnings_of=self.foresight.warnings,
            journal=Journal(settings.postmortem_dir),
            boot_id=read_boot_id(settings.proc_root),
        )
        self.stranded = StrandTracker(
            lambda: self.deaths.ledger.times, self.deaths.on_stranded, window=self.stalls.window
        )
        self.sources = Sources()  # how deaths are heard here: known once the watchers start
        self.watch_deaths = watch_deaths
        self.connector: ProcConnector | None = None
        self.kmsg: KmsgWatcher | None = None
        self.signals: SignalWatcher | None = None
        self.pidfds: PidfdWatcher | None = None
        self._snapshot: Snapshot | None = None
        # The round plan's parts (RoundPlan): near a limit; the last snapshot as published
        # (what a round between two detailed ones carries); the rounds the schedule missed.
        self.pressure = False
        self._judged: Snapshot | None = None
        self.overruns_total = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # the stop, or a new agent told by the connector
        self._thread: threading.Thread | None = None
        self._last_done: float | None = None
        self._idle = False  # no job watched and the connector tells when one starts
        self.protection: list[protection.Grant] = []  # what the kernel granted the daemon at start

    @property
    def snapshot(self) -> Snapshot | None:
        with self._lock:
            return self._snapshot

    def start(self) -> None:
        if self._thread is not None:
            return
        s = self.settings
        if s.oom_score_adj is not None:
            self.protection.append(protection.set_oom_score_adj(s.oom_score_adj, f"{s.proc_root}/self"))
        if s.self_protection:
            self.protection.append(protection.lock_memory())
        saferead.prestart()  # the death path's reader threads exist before any death
        if self.watch_deaths and not ask_zombie_status(s.proc_root):
            log.info(
                "this kernel gives no zombie's exit status in /proc (gVisor writes 0): exits are told "
                "by the process connector, pidfds and the agent's log; a zombie read alone is unknown"
            )
        # what an earlier run of the daemon was watching (it may have died mid-incident)
        journal = self.deaths.journal
        saved = journal.load(self.deaths.boot_id) if journal is not None and self.watch_deaths else None
        if self.watch_deaths:
            self.sources = self._start_watchers(saved)
        if saved is not None and saved.ranks:
            n = self.deaths.restore(saved)
            log.info(
                "journal: %d rank(s) of an earlier run known; %d job(s) had deaths while trainwatch was down",
                len(saved.ranks),
                n,
            )
        self.deaths.start(self.sources)
        if s.self_protection:  # every thread that exists now, and so the ones they start
            self.protection.append(protection.raise_priority())  # its own tasks: the real /proc, always
        for g in self.protection:
            if g.granted:
                log.info("self-protection: %s: %s", g.kind, g.detail)
            else:  # INFO: an unprivileged `trainwatch run` is refused by design; doctor and the metric tell
                log.info("self-protection: %s not granted: %s", g.kind, g.detail)
        self._stop.clear()
        self._wake.clear()
        self._thread = threading.Thread(target=self._run, name="trainwatch-sampler", daemon=True)
        self._thread.start()

    def _start_watchers(self, saved: SavedState | None = None) -> Sources:
        """Start each event source this node allows; say which work."""
        off = self.settings.disabled
        first_hand, catch_up = False, None
        for source in sorted(off):
            log.info("%s: turned off by --disable", source)
        if "connector" not in off:
            connector = ProcConnector(
                self.deaths.on_exit,
                on_overrun=lambda: self.deaths.resync(self.settings.proc_root),
                rcvbuf=self.settings.connector_buffer_bytes,
                discovery=True,
                on_agent=self._wake.set,
            )
            try:
                connector.start()
                self.connector = connector
                first_hand = True
                if connector.discovering:
                    self.sampler.discovery.listen(connector.drain, connector.watch)
                log.info(
                    "exits: process connector subscribed (%s)",
                    "forks, renames and exits of watched processes, filtered in the kernel; /proc "
                    "listed every few seconds"
                    if connector.discovering
                    else "non-zero exits only"
                    if connector.filtered
                    else "all exits",
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
            self.sampler.discovery.report_gone(
                lambda key: self.deaths.on_unknown(key.pid, time.monotonic_ns())
            )
            self.sampler.on_zombie = self.deaths.on_exit
        if "kmsg" not in off:
            kmsg = KmsgWatcher(self.deaths.on_kmsg, on_loss=self.deaths.on_kmsg_loss)
            since = None
            if saved is not None and saved.ranks:  # the records of the saved ranks' lifetimes
                first = min(k.sample.key.start_ticks for k in saved.ranks)
                since = max(0, first * 10**6 // TICKS_PER_SECOND - 10**6)
            try:
                kmsg.start(history_since_us=since)
                if since is not None:
                    log.info(
                        "kernel log: %d record(s) of the ring's history read for the earlier run's ranks",
                        kmsg.history,
                    )
                self.kmsg = kmsg
                catch_up = kmsg.catch_up
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
        return Sources(exits_first_hand=first_hand, kernel_catch_up=catch_up)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for watcher in (self.connector, self.kmsg, self.signals, self.pidfds):
            if watcher is not None:
                watcher.stop()
        self.connector = self.kmsg = self.signals = self.pidfds = None
        self.deaths.stop()  # finishes any postmortem in flight
        self.sampler.gpu.close()

    def lost_events(self) -> dict[str, int]:
        """What the event sources lost before they were read (the watchers that run)."""
        lost = {}
        if self.kmsg is not None:
            lost["kmsg"] = self.kmsg.lost
        if self.connector is not None:
            lost["connector"] = self.connector.overruns
        return lost

    def healthy(self) -> tuple[bool, str]:
        """(ok, why): the sampler thread is alive and finished a round recently."""
        if self._thread is None or not self._thread.is_alive():
            return False, "sampler not running"
        if self._last_done is None:
            return False, "no sample yet"
        age = time.monotonic() - self._last_done
        if age > self.settings.sampler_stall_seconds + (IDLE_INTERVAL_SECONDS if self._idle else 0.0):
            return False, f"sampler stalled: last sample {age:.1f}s ago"
        return True, "ok"

    def sample_now(self) -> Snapshot:
        """Run one round on the caller's thread and publish it (tests, one-shot use)."""
        snapshot = self.sampler.sample(self._plan())
        self._publish(snapshot)
        return snapshot

    def _plan(self) -> RoundPlan:
        return RoundPlan(self.pressure, self._judged, self.overruns_total)

    def _publish(self, snapshot: Snapshot) -> None:
        # forecasts and stalls are judged once a second (every round near a limit); the
        # sampler builds a round between with their last word (RoundPlan.judged)
        if snapshot.detail or self._snapshot is None:
            snapshot = self.foresight.update(snapshot)
            snapshot = self.stalls.update(snapshot)
            snapshot = self.stranded.update(snapshot)
        self._judged = snapshot
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
                snapshot = self.sampler.sample(self._plan())
                self._publish(snapshot)
            except Exception:
                log.exception("sampling round failed")
            fast = snapshot is not None and under_pressure(snapshot)
            self.pressure = fast  # near a limit: every file, every round
            if fast != (interval < base):
                if fast:
                    log.info(
                        "memory is near a limit: sampling every %gs until it is not",
                        PRESSURE_INTERVAL_SECONDS,
                    )
                else:
                    log.info("memory pressure is over: back to sampling every %gs", base)
            discovery = self.sampler.discovery
            self._idle = not discovery.jobs and discovery.hears_changes  # not even an agent
            if self._idle:
                interval = max(base, IDLE_INTERVAL_SECONDS)
            else:
                interval = min(base, PRESSURE_INTERVAL_SECONDS) if fast else base
            deadline += interval
            now = clock()
            if now > deadline:
                missed = int((now - deadline) // interval) + 1
                self.overruns_total += missed
                deadline += missed * interval
            if self._wake.wait(max(0.0, deadline - now)) and not self._stop.is_set():
                self._wake.clear()  # a new agent: a round now, the schedule from here
                deadline = clock()
