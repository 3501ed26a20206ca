"""Deaths, live: exit events and kernel log records in, postmortems out.

The sampler tells this room which processes are ranks (``observe``, every round); the
process connector reports exits (``on_exit``) and the kernel log its OOM records
(``on_kmsg``), each from its own thread. The first abnormal death of a rank opens an
*incident* for its job; a worker thread runs the autopsy a quarter of a second later
(time for the kernel's records to arrive, well inside the 1 s budget), writes the
postmortem, and rewrites it as the other ranks' fates become known and when the agent
exits. The sampler is never blocked: all of this happens on the worker thread. This room
reads no file itself: ``gather.Gatherer`` does, outside the lock, and ``records.Records``
keeps what the kernel log, the tracepoint and NVML reported.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sidecar.autopsy import (
    Evidence,
    Verdict,
    autopsy,
    signal_name,
)
from sidecar.foresight import Warned
from sidecar.gather import Gatherer
from sidecar.incidents import (
    Generation,
    Incident,
    Known,
    Plan,
    Reads,
    clean_end,
    join_evidence,
    killers_of,
    live_parts,
    plan_of,
    remember,
)
from sidecar.journal import SAVE_EVERY_S, Journal, State, thin
from sidecar.model import Snapshot, decode_wait_status
from sidecar.parse.kernel import (
    KmsgRecord,
)
from sidecar.postmortem import PostmortemStore, build, iso, make_id
from sidecar.probes.outputs import OutputFile, run_spool
from sidecar.probes.senders import describe_sender
from sidecar.reconstruct import incidents_of, killed_at, revive, state_of, watched
from sidecar.records import EVERY_INCIDENT, Records
from sidecar.timeline import Timeline
from sidecar.watch.exits import ExitEvent
from sidecar.watch.signals import ENDING_SIGNALS, SignalEvent

__all__ = ["DeathWatch"]

log = logging.getLogger(__name__)

AUTOPSY_DELAY_S = 0.25
INCIDENT_QUIET_S = 60.0  # an incident closes this long after its last death (or at agent exit)
KNOWN_GRACE_S = 120.0  # ranks gone from the snapshot are remembered this long
TIMELINE_WINDOW_S = 300.0
# A death whose exit status nobody could tell (no connector, no pidfd, the zombie missed)
# waits this long for the agent's log or the agent's own exit before it is judged: at a
# clean end of training every rank "vanishes" too, and that is no incident.
UNKNOWN_EXIT_WAIT_S = 3.0
RETRY_WRITE_NS = 5 * 10**9  # while a postmortem is in memory only, how often to write it again
SLOW_READS_MS = 200.0  # an autopsy round whose reads take longer says so in the log
SPOOL_TRIES = 10  # rounds a job that names a `trainwatch run` output file is looked at for it
DEATH_TIMES = 64  # deaths whose time is exported (trainwatch_rank_death_timestamp_seconds)
# observe() at 10 Hz: the latest samples every round; forgetting what is gone, the spools
# and the journal's check once a second (and in any round with a new rank, agent or cgroup)
TIDY_NS = 10**9
AGENT_GRACE_NS = 30 * 10**9  # an agent's output files are kept this long after its job left the rounds
WALL_STEP_S = 0.05  # the wall clock moved this far against the monotonic one: it was stepped


class DeathWatch:
    def __init__(
        self,
        store: PostmortemStore,
        timeline: Timeline,
        *,
        read_host_oom_kills: Callable[[], int | None] = lambda: None,
        read_cgroup_oom_kills: Callable[[str, int], int | None] = lambda path, version: None,
        read_oomd_marks: Callable[[str, int], dict[str, int]] = lambda path, version: {},
        read_outputs: bool = True,
        job_output: Callable[[int], str] | None = None,
        stall_of: Callable[[str], dict[str, Any] | None] | None = None,
        warnings_of: Callable[[str], tuple[Warned, ...]] = lambda job: (),
        hostname: str | None = None,
        proc_root: str = "/proc",
        journal: Journal | None = None,
        boot_id: str | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.timeline = timeline
        self.stall_of = stall_of  # the snapshot taken when the job stalled (stalls.py)
        self.warnings_of = warnings_of  # what foresight predicted for a job (foresight.py)
        self.hostname = hostname or socket.gethostname()
        self.gather = Gatherer(
            proc_root=proc_root,
            read_outputs=read_outputs,
            job_output=job_output,
            read_host_oom_kills=read_host_oom_kills,
            read_cgroup_oom_kills=read_cgroup_oom_kills,
            read_oomd_marks=read_oomd_marks,
            clock_ns=clock_ns,
            wall=wall,
        )
        self.clock_ns = clock_ns
        self.wall = wall
        self.kernel_log_readable = False
        self.exits_first_hand = False
        self.deaths_total: dict[tuple[str, str], int] = {}
        # (job, rank, restart) -> (killer, wall time of death): the newest DEATH_TIMES deaths,
        # for dashboards' annotations and a job's first death across nodes
        self.death_times: dict[tuple[str, str, int], tuple[str, float]] = {}
        self._known: dict[int, Known] = {}
        self._snapshots: deque[tuple[int, Snapshot]] = deque(maxlen=8)
        self._records = Records()  # the kernel log's, the tracepoint's and NVML's records
        self._rank_gpus: dict[int, frozenset[int]] = {}  # rank pid -> GPUs NVML ever gave it memory on
        self._reported: dict[int, int] = {}  # pid -> ns: an exit was reported (any status)
        self._clean_exits: dict[int, tuple[int, str | None]] = {}  # pid -> (ns, source), before any incident
        self._agent_outputs: dict[int, list[OutputFile]] = {}  # agent pid -> its output files
        self._spool_tries: dict[int, int] = {}  # agent pid -> looks for its `trainwatch run` output
        # rank pid -> (its own output files, the wall time it was first seen)
        self._rank_files: dict[int, tuple[list[OutputFile], float]] = {}
        self._oomd_baseline: dict[tuple[str, int], dict[str, int]] = {}  # cgroup -> oomd xattrs
        # One incident per job and worker generation: after an elastic restart the new
        # generation's deaths get a postmortem of their own.
        self._incidents: dict[Generation, Incident] = {}
        self.journal = journal if boot_id is not None else None  # without a boot id it could mislead
        self.boot_id = boot_id or ""
        self._journal_at = 0  # monotonic ns of the last save
        self._journal_sig: object = None  # what the last save held, in short
        self._tidy_ns = 0  # observe(): when to forget the gone, look for spools and save next
        self._wall_offset: float | None = None  # wall minus monotonic seconds (_wall)
        self._agents_seen: dict[int, int] = {}  # agent pid -> the last round that saw it (ns)
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- feeds ---------------------------------------------------------------------

    def observe(self, snap: Snapshot) -> None:
        """Sampler thread: remember the live ranks and the snapshot (for counters)."""
        now = self.clock_ns()
        cgroups = {c.path: c for c in snap.cgroups}
        with self._cv:
            self._snapshots.append((now, snap))
            self._records.gpus(snap, now)
            for job in snap.jobs:
                self._agents_seen[job.agent.pid] = now
                gens: dict[int, Generation] = {}  # restart -> the generation (one a job, as a rule)
                for r in job.ranks:
                    if r.gpu_memory_bytes:  # a lost GPU lists no processes: remember the earlier ones
                        self._rank_gpus[r.key.pid] = self._rank_gpus.get(r.key.pid, frozenset()) | set(
                            r.gpu_memory_bytes
                        )
                    cg = cgroups.get(r.cgroup or "")
                    gen = gens.get(r.restart)
                    if gen is None:
                        gen = gens[r.restart] = Generation(
                            job.key, job.agent.pid, job.run_id, job.world_size, r.restart, job.entrypoint
                        )
                    self._known[r.key.pid] = Known(gen, r, cg.limited_by if cg else None, now)
            new_ranks = [
                r.key.pid for job in snap.jobs for r in job.ranks if r.key.pid not in self._rank_files
            ]
            agents = {job.agent.pid for job in snap.jobs}
            new_agents = [p for p in agents if p not in self._agent_outputs]
            new_cgroups = [
                (c.path, c.version) for c in snap.cgroups if (c.path, c.version) not in self._oomd_baseline
            ]
            if now < self._tidy_ns and not (new_ranks or new_agents or new_cgroups):
                return  # nothing new: forgetting, the outputs' spools and the journal once a second
            self._tidy_ns = now + TIDY_NS
            cutoff = now - int(KNOWN_GRACE_S * 1e9)
            for pid in [p for p, k in self._known.items() if k.seen_ns < cutoff]:
                del self._known[pid]
            for pid in [p for p, ns in self._reported.items() if ns < cutoff]:
                del self._reported[pid]
            for pid in [p for p, (ns, _) in self._clean_exits.items() if ns < cutoff]:
                del self._clean_exits[pid]
            for pid in [p for p in self._rank_files if p not in self._known]:
                del self._rank_files[pid]
            for pid in [p for p in self._rank_gpus if p not in self._known]:
                del self._rank_gpus[pid]
            for gone in [p for p in self._agent_outputs if p not in agents]:
                # kept a while after its agent left the rounds: its ranks' exits may be told
                # after a round saw the job gone (the connector's reader runs on its own
                # thread; after a stall, or lost events, the round can come first)
                if now - self._agents_seen.get(gone, 0) < AGENT_GRACE_NS:
                    continue
                if not any(inc.gen.agent_pid == gone for inc in self._incidents.values()):
                    del self._agent_outputs[gone]
                    self._agents_seen.pop(gone, None)
                    self.gather.forget(gone)
            for gone in [p for p in self._spool_tries if p not in agents]:
                del self._spool_tries[gone]
            # jobs under `trainwatch run` (not this one's own): its copy of their output
            spools = {
                job.agent.pid: (r.run_output, r.uid)
                for job in snap.jobs
                for r in job.ranks
                if r.run_output and self._spool_tries.get(job.agent.pid, 0) < SPOOL_TRIES
            }
            if self.gather.job_output is not None or not self.gather.read_outputs:
                spools = {}
            known_files = [f for files in self._agent_outputs.values() for f in files]
        # Outside the lock (file system calls), once per new job, rank and cgroup
        outputs, rank_files, marks = self.gather.newcomers(new_agents, new_ranks, new_cgroups, known_files)
        found = {a: run_spool(self.gather.proc_root, a, path, uid) for a, (path, uid) in spools.items()}
        with self._cv:
            for agent, spool in found.items():
                if spool is None:
                    self._spool_tries[agent] = self._spool_tries.get(agent, 0) + 1
                    continue
                self._spool_tries[agent] = SPOOL_TRIES  # found: looked for no more
                files = outputs.get(agent) or self._agent_outputs.get(agent) or []
                outputs[agent] = [*files, spool]
                log.info(
                    "job of agent %d runs under trainwatch run: reading its output from %r", agent, spool.path
                )
            self._rank_files.update(rank_files)
            self._agent_outputs.update(outputs)
            self._oomd_baseline.update(marks)
            for job_key in [
                k
                for k, inc in self._incidents.items()
                if inc.due_ns is None and now - inc.last_death_ns > INCIDENT_QUIET_S * 1e9
            ]:
                del self._incidents[job_key]
        self._save(now)

    def on_exit(self, event: ExitEvent) -> None:
        """Connector or pidfd thread (or the sampler's zombie fallback): a process exited."""
        with self._cv:
            self._reported[event.pid] = event.monotonic_ns
            self._ended(event.pid, event.exit_code, event.monotonic_ns, event.source)

    def on_unknown(self, pid: int, monotonic_ns: int) -> None:
        """A watched process ended and nobody could tell its exit status (pidfd after the
        reap on an old kernel, or the sampler found it gone)."""
        with self._cv:
            if pid in self._reported:
                return  # its status came another way
            self._reported[pid] = monotonic_ns
            self._ended(pid, None, monotonic_ns, None)

    def _ended(self, pid: int, exit_code: int | None, at_ns: int, source: str | None) -> None:
        known = self._known.get(pid)
        if known is None:
            for open_inc in self._incidents.values():
                if open_inc.gen.agent_pid == pid and open_inc.agent_exit is None:
                    open_inc.agent_exit = (exit_code, at_ns)
                    self._schedule(open_inc, at_ns)
            return
        self._record(known, pid, exit_code, at_ns, source)

    def resync(self, proc_root: str = "/proc") -> None:
        """After the connector lost events (ENOBUFS): every known rank that is gone and
        whose exit nobody reported died with an unknown exit status.

        Not only the ranks the last round saw: the sampler may have run a round between the
        loss and this call (both threads wake together after a stall) and seen them gone
        already. A rank that ended before the loss had its exit reported (``_reported``),
        or was resynchronised at an earlier loss (its incident holds it)."""
        now = self.clock_ns()
        with self._cv:
            for pid, known in list(self._known.items()):
                if pid in self._reported or any(pid in inc.deaths for inc in self._incidents.values()):
                    continue
                if not self.gather.alive(known.sample.key, proc_root):
                    log.warning(
                        "job %s: rank %s (pid %d) vanished while exit events were lost; exit status unknown",
                        known.gen.job,
                        known.sample.rank_label,
                        pid,
                    )
                    self._reported[pid] = now  # told now: a later overrun does not tell it again
                    self._record(known, pid, None, now, None)

    def _record(self, known: Known, pid: int, exit_code: int | None, at_ns: int, source: str | None) -> None:
        inc = self._incidents.get(known.gen)
        if inc is None:
            if exit_code == 0:
                # a clean exit opens no incident, but is remembered: a sibling's death that
                # opens one later must not count this rank as still running
                self._clean_exits[pid] = (at_ns, source)
                return
            inc = self._open(known, pid, exit_code, at_ns)
        if pid in inc.deaths:
            return
        inc.deaths[pid] = (exit_code, at_ns, source)
        inc.last_death_ns = max(inc.last_death_ns, at_ns)
        wait = UNKNOWN_EXIT_WAIT_S if all(d[0] is None for d in inc.deaths.values()) else 0.0
        self._schedule(inc, at_ns + int(wait * 1e9))

    def on_signal(self, event: SignalEvent) -> None:
        """Tracepoint thread: keep the signals sent to ranks and to their agents (an agent
        signalled from outside tears its ranks down); the rest is not evidence."""
        if event.signal not in ENDING_SIGNALS:
            return  # the tracepoint's filter passes only these; a caller may not have one
        if event.target_pid not in self._known and event.target_pid not in self._agents():
            return
        sender = None
        if not event.from_kernel and event.sender_pid != event.target_pid:
            # read now, outside the lock: a `kill` is gone within milliseconds
            sender = describe_sender(self.gather.proc_root, event.sender_pid, event.sender_comm)
        with self._cv:
            if event.target_pid not in self._known and event.target_pid not in self._agents():
                return
            self._records.signal(event, sender)

    def _agents(self) -> set[int]:
        """The agents of the ranks known (a copy: read from the tracepoint's thread too)."""
        return {k.gen.agent_pid for k in list(self._known.values())}

    def on_kmsg(self, record: KmsgRecord) -> None:
        """Kernel-log thread: keep the OOM records (merged per pid), the NVRM Xids, and the
        lines Meta's oomd writes into the kernel log from user space."""
        parsed = Records.parse(record)
        if parsed is None:
            return
        with self._cv:
            touched = self._records.add(parsed)
            if touched is None:
                return
            for inc in self._incidents.values():
                if inc.deaths and (touched == EVERY_INCIDENT or touched in inc.deaths):
                    self._schedule(inc, self.clock_ns())

    def on_kmsg_loss(self, count: int, timestamp_us: int) -> None:
        """Kernel-log thread: records were overwritten unread (an overrun): a death near
        them may lack the record that would explain it."""
        with self._cv:
            self._records.kmsg_losses.append((timestamp_us * 1000, count))
            for inc in self._incidents.values():
                if inc.deaths:
                    self._schedule(inc, self.clock_ns())

    # -- across a restart (journal.py) -----------------------------------------------

    def _save(self, now: int) -> None:
        """Write the journal when what it would hold changed, else every SAVE_EVERY_S
        while ranks are watched. Built under the lock, written outside it."""
        if self.journal is None:
            return
        with self._cv:
            latest = self._snapshots[-1] if self._snapshots else None
            ranks, substance = watched(self._known, latest, self._incidents.values())
            if substance == self._journal_sig and (not ranks or now - self._journal_at < SAVE_EVERY_S * 1e9):
                return
            self._journal_sig, self._journal_at = substance, now
            state = state_of(
                self.boot_id,
                now,
                self.wall(),
                ranks,
                latest,
                self._incidents.values(),
                self._agent_outputs,
                {pid: files for pid, (files, _) in self._rank_files.items()},
            )
        since = self.wall() - TIMELINE_WINDOW_S
        curves = {job: thin(self.timeline.window(job, since)) for job in {k.gen.job for k in state.ranks}}
        self.journal.save(replace(state, curves=curves))

    def restore(self, state: State) -> int:
        """At start, with the kernel log's history already fed in (``on_kmsg``): judge the
        deaths of the saved ranks that happened while the daemon was down, from that
        history, the agent's log and the cgroups' counters. Returns how many jobs."""
        now = self.clock_ns()
        with self._cv:
            kills = [(k.pid, k.at_ns) for k in self._records.ooms.kills]
        revived = revive(state, self.gather.alive, killed_at(kills), now)
        for job, points in state.curves.items():
            self.timeline.restore(job, list(points))
        with self._cv:
            self._agent_outputs.update({p: list(f) for p, f in state.agent_files.items()})
            for r, inc in zip(revived, incidents_of(state, revived, now, self.wall()), strict=True):
                for pid, k in r.ranks.items():
                    self._known.setdefault(pid, k)
                    self._rank_files.setdefault(pid, (list(state.rank_files.get(pid, ())), state.saved_wall))
                self._incidents[r.gen] = inc
                self._schedule(inc, now)
                log.warning(
                    "job %s: %d rank(s) died while trainwatch was down (pids %s); judging from the "
                    "kernel log's history and the agent's log",
                    r.gen.job,
                    len(r.new_dead),
                    ", ".join(map(str, r.new_dead)),
                )
        return len(revived)

    # -- incidents -----------------------------------------------------------------

    def _open(self, known: Known, pid: int, exit_code: int | None, at_ns: int) -> Incident:
        ranks = {rank_pid: k for rank_pid, k in self._known.items() if k.gen == known.gen}
        # The memory "at death" is the last snapshot that saw the victim alive (a snapshot
        # can be published just after the death it predates, so not "the last one before").
        before = next(
            (
                s
                for _, s in reversed(self._snapshots)
                if any(r.key.pid == pid for j in s.jobs for r in j.ranks)
            ),
            None,
        )
        if before is None:
            before = next((s for ns, s in reversed(self._snapshots) if ns <= at_ns), None)
        inc = Incident(known.gen, ranks, snapshot_before=before)
        for rank_pid in ranks:
            if rank_pid in self._clean_exits:  # siblings that had already ended cleanly
                ns, source = self._clean_exits.pop(rank_pid)
                inc.deaths[rank_pid] = (0, ns, source)
        if before is not None and before.host is not None:
            inc.host_oom_before = before.host.oom_kills
        if before is not None:
            inc.cgroup_oom_before = {c.path: c.oom_kills for c in before.cgroups if c.oom_kills is not None}
        self._incidents[known.gen] = inc
        log.warning(
            "job %s: rank %s (pid %d) died (%s, told %.0f ms later); writing a postmortem",
            known.gen.job,
            known.sample.rank_label,
            pid,
            _exit_text(exit_code),
            max(0, self.clock_ns() - at_ns) / 1e6,
        )
        return inc

    def _schedule(self, inc: Incident, at_ns: int) -> None:
        due = max(at_ns, self.clock_ns()) + int(AUTOPSY_DELAY_S * 1e9)
        if inc.due_ns is None or due < inc.due_ns:
            inc.due_ns = due
        self._cv.notify()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread this runs on, once started (for its priority)."""
        return self._thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainwatch-deaths", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the postmortems in flight, then stop."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _run(self) -> None:
        while True:
            if self.store.unwritten:
                self.store.retry()
            with self._cv:
                ready = []
                while True:
                    due = [inc for inc in self._incidents.values() if inc.due_ns is not None]
                    now = self.clock_ns()
                    ready = [inc for inc in due if inc.due_ns is not None and inc.due_ns <= now]
                    if ready or (self._stop and not due):
                        break
                    if self._stop:  # finish what is pending right away
                        ready = due
                        break
                    wait = min((inc.due_ns - now for inc in due if inc.due_ns is not None), default=None)
                    if self.store.unwritten:  # a full or read-only directory: try again soon
                        wait = min(wait if wait is not None else RETRY_WRITE_NS, RETRY_WRITE_NS)
                        if not self._cv.wait(wait / 1e9):
                            break  # timed out: retry the writes below
                        continue
                    self._cv.wait(None if wait is None else wait / 1e9)
                if not ready and self._stop:
                    return
                late = {id(inc): (now - (inc.due_ns or now)) / 1e6 for inc in ready}  # ms past due
                for inc in ready:
                    inc.due_ns = None
                plans = [(inc, self._plan(inc)) for inc in ready]
            # The files (outputs, dumps, cgroup counters, /proc) are read and parsed outside
            # the lock: the sampler and the exit threads never wait on a 2 MiB log.
            # Nothing a round meets may end this thread: a failed read gives a postmortem
            # from what the feeds recorded (the exits, the kernel's records) without it.
            reads = []
            for inc, plan in plans:
                started = time.perf_counter()
                try:
                    reads.append((inc, self.gather.read(inc, plan)))
                except Exception:
                    log.exception("job %s: reading the job's files failed; writing without them", inc.gen.job)
                    reads.append((inc, Reads.nothing()))
                self._took(inc, started, late.get(id(inc), 0.0))
            with self._cv:
                work = [(inc, self._evidence(inc, r)) for inc, r in reads]
            for inc, evidence in work:
                started = time.perf_counter()
                try:
                    self._write(inc, evidence)
                except Exception:
                    log.exception("job %s: postmortem failed", inc.gen.job)
                log.debug(
                    "job %s: autopsy and write %.0f ms", inc.gen.job, (time.perf_counter() - started) * 1000
                )

    def _took(self, inc: Incident, started: float, late_ms: float) -> None:
        """Log how late the round started and how long its reads took, step by step: at
        INFO when it was slow (a postmortem is due within ~1 s of the death)."""
        ms = (time.perf_counter() - started) * 1000
        level = logging.INFO if ms + late_ms > SLOW_READS_MS else logging.DEBUG
        steps = ", ".join(f"{k} {v:g}" for k, v in self.gather.timings.items())
        log.log(
            level,
            "job %s: autopsy round %.0f ms late; its reads took %.0f ms (%s)",
            inc.gen.job,
            late_ms,
            ms,
            steps,
        )

    def _plan(self, inc: Incident) -> Plan:
        """Under the lock: what the reads of this round need from the shared state."""
        return plan_of(inc, self._agent_outputs, self._rank_files, self._oomd_baseline)

    def _stall(self, inc: Incident) -> dict[str, Any] | None:
        if self.stall_of is None or inc.stall is not None:
            return inc.stall  # kept: the tracker forgets a job once it is gone
        snap = self.stall_of(inc.gen.job)
        if snap:
            inc.stall = {**snap, "detected_at": iso(snap["detected_at"]), "ended_at": iso(snap["ended_at"])}
        return inc.stall

    def _evidence(self, inc: Incident, reads: Reads) -> Evidence:
        """Under the lock: the round's reads joined with what the feeds recorded."""
        latest = self._snapshots[-1][1] if self._snapshots else None
        return join_evidence(
            inc,
            reads,
            self._records,
            latest=latest,
            rank_gpus=self._rank_gpus,
            kernel_log_readable=self.kernel_log_readable,
            exits_first_hand=self.exits_first_hand,
        )

    # -- the document --------------------------------------------------------------

    def _wall(self, ns: int | None) -> float | None:
        """The wall time of a monotonic instant. The clocks' offset is kept between calls
        (renewed when the wall clock was stepped): a document rebuilt later (a late fate,
        a retried write) gives the same event the same time, not one a millisecond off."""
        if ns is None:
            return None
        offset = self.wall() - self.clock_ns() / 1e9
        if self._wall_offset is None or abs(offset - self._wall_offset) > WALL_STEP_S:
            self._wall_offset = offset
        return ns / 1e9 + self._wall_offset

    def _write(self, inc: Incident, ev: Evidence) -> None:
        verdict = autopsy(ev)
        if verdict is None:
            return
        if inc.doc_id is None:
            clean = clean_end(inc, ev, verdict, readable_log=bool(self._agent_outputs.get(inc.gen.agent_pid)))
            if clean:
                log.info(
                    "job %s: ranks ended with exit statuses unknown; %s: no postmortem",
                    inc.gen.job,
                    "trainwatch was down when they ended and nothing tells how (no kernel record, no "
                    "failing exit in a readable agent log, no OOM counter moved): taken as a clean end"
                    if inc.reconstructed
                    else "the agent's exit and log say it was a clean end",
                )
                return
            if clean is None and self.clock_ns() - inc.last_death_ns < 4 * UNKNOWN_EXIT_WAIT_S * 1e9:
                with self._cv:
                    self._schedule(inc, self.clock_ns() + int(UNKNOWN_EXIT_WAIT_S * 1e9))
                return
        first = inc.doc_id is None
        died_at = self._wall(verdict.victim.died_ns) or self.wall()
        if inc.doc_id is None:
            inc.doc_id = make_id(
                died_at, inc.gen.agent_pid, verdict.victim.label, self.hostname, inc.gen.restart
            )
            inc.created_at = self.wall()
        doc = self._document(inc, verdict, died_at, ev)
        self.store.put(doc, first=first)
        with self._cv:
            for r, killer in killers_of(verdict, ev):
                if r.pid in inc.counted:
                    continue
                inc.counted[r.pid] = killer
                self.deaths_total[(inc.gen.job, killer)] = self.deaths_total.get((inc.gen.job, killer), 0) + 1
                when = self._wall(r.died_ns) or died_at
                key = (inc.gen.job, r.label, inc.gen.restart)
                # a new dict, swapped whole: the scrape reads it without the lock
                self.death_times = remember(self.death_times, key, (killer, when), DEATH_TIMES)
        if first:
            log.warning(
                "job %s: postmortem %s: %s (%s)", inc.gen.job, inc.doc_id, verdict.summary, verdict.confidence
            )
        self._save(self.clock_ns())

    def _document(self, inc: Incident, v: Verdict, died_at: float, ev: Evidence) -> dict[str, Any]:
        return build(
            live_parts(
                inc,
                v,
                died_at,
                ev,
                points=self.timeline.window(inc.gen.job, since=died_at - TIMELINE_WINDOW_S),
                wall_of=self._wall,
                updated_at=self.wall(),
                hostname=self.hostname,
                stall=self._stall(inc),
                warnings=[
                    w
                    for w in self.warnings_of(inc.gen.job)
                    if w.restart == inc.gen.restart and w.at <= died_at
                ],
            )
        )


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    status, sig = decode_wait_status(code)
    return f"signal {signal_name(sig)}" if sig is not None else f"exit status {status}"
