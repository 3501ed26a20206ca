"""A death heard: the feeds of the death watch, each on its own thread. The sampler tells which
processes are ranks (``observe``, every round); the process connector and pidfds report
exits (``on_exit``, ``on_unknown``, ``resync`` after lost events), the tracepoint the
signals sent (``on_signal``), the kernel log its records (``on_kmsg``). The first abnormal
death of a rank opens an *incident* for its job and worker generation; every feed only
records and schedules, under the shared lock (``state.Watched``): the autopsy runs on the
worker's thread (``write.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sidecar import lognames
from sidecar.autopsy import signal_name
from sidecar.deaths.gather import Gatherer
from sidecar.deaths.incidents import Generation, Incident, Known
from sidecar.deaths.records import EVERY_INCIDENT, Records
from sidecar.deaths.state import UNKNOWN_EXIT_WAIT_S, Watched
from sidecar.model import CgroupSample, Snapshot, decode_wait_status
from sidecar.model.events import ENDING_SIGNALS, ExitEvent, SignalEvent
from sidecar.parse.kernel import KmsgRecord

__all__ = ["Feeds"]

log = logging.getLogger(lognames.DEATHS)

INCIDENT_QUIET_S = 60.0  # an incident closes this long after its last death (or at agent exit)
KNOWN_GRACE_S = 120.0  # ranks gone from the snapshot are remembered this long
SPOOL_TRIES = 10  # rounds a job that names a `trainwatch run` output file is looked at for it
# observe() at 10 Hz: the latest samples every round; forgetting what is gone, the spools
# and the journal's check once a second (and in any round with a new rank, agent or cgroup)
TIDY_NS = 10**9
# a victim still exiting is listed by rounds after its OOM kill was counted (hear._counters_before)
COUNTERS_MARGIN_NS = 10**9
AGENT_GRACE_NS = 30 * 10**9  # an agent's output files are kept this long after its job left the rounds


class Feeds:
    """The death watch's ears: each feed (a round, an exit, a signal, a kernel record, a
    stranding) only records, under the lock, and schedules an incident when a rank died;
    nothing is read here. ``save_journal(now_ns)``: the journal's save, after a round."""

    def __init__(
        self,
        state: Watched,
        gather: Gatherer,
        save_journal: Callable[[int], None],
        clock_ns: Callable[[], int],
    ) -> None:
        self.state = state
        self.gather = gather
        self.save_journal = save_journal
        self.clock_ns = clock_ns
        self._spool_tries: dict[int, int] = {}  # agent pid -> looks for its `trainwatch run` output
        self._tidy_ns = 0  # observe(): when to forget the gone, look for spools and save next
        self._agents_seen: dict[int, int] = {}  # agent pid -> the last round that saw it (ns)

    def observe(self, snap: Snapshot) -> None:
        """Sampler thread: remember the live ranks and the snapshot (for counters)."""
        now = self.clock_ns()
        cgroups = {c.path: c for c in snap.cgroups}
        with self.state.cv:
            self.state.snapshots.append((now, snap))
            self.state.records.gpus(snap, now)
            for job in snap.jobs:
                self._agents_seen[job.agent.pid] = now
                gens: dict[int, Generation] = {}  # restart -> the generation (one a job, as a rule)
                for r in job.ranks:
                    if r.gpu_memory_bytes:  # a lost GPU lists no processes: remember the earlier ones
                        self.state.rank_gpus[r.key.pid] = self.state.rank_gpus.get(
                            r.key.pid, frozenset()
                        ) | set(r.gpu_memory_bytes)
                    cg = cgroups.get(r.cgroup or "")
                    gen = gens.get(r.restart)
                    if gen is None:
                        gen = gens[r.restart] = Generation(
                            job.key,
                            job.agent.pid,
                            job.run_id,
                            job.world_size,
                            r.restart,
                            job.entrypoint,
                            job.launcher,
                        )
                    self.state.known[r.key.pid] = Known(gen, r, cg.limited_by if cg else None, now)
            new_ranks = [
                r.key.pid for job in snap.jobs for r in job.ranks if r.key.pid not in self.state.rank_files
            ]
            agents = {job.agent.pid for job in snap.jobs}
            new_agents = [p for p in agents if p not in self.state.agent_outputs]
            new_cgroups = [
                (c.path, c.version)
                for c in snap.cgroups
                if (c.path, c.version) not in self.state.oomd_baseline
            ]
            if now < self._tidy_ns and not (new_ranks or new_agents or new_cgroups):
                return  # nothing new: forgetting, the outputs' spools and the journal once a second
            self._tidy_ns = now + TIDY_NS
            cutoff = now - int(KNOWN_GRACE_S * 1e9)
            for pid in [p for p, k in self.state.known.items() if k.seen_ns < cutoff]:
                del self.state.known[pid]
            for pid in [p for p, ns in self.state.reported.items() if ns < cutoff]:
                del self.state.reported[pid]
            for pid in [p for p, (ns, _) in self.state.clean_exits.items() if ns < cutoff]:
                del self.state.clean_exits[pid]
            for pid in [p for p in self.state.rank_files if p not in self.state.known]:
                del self.state.rank_files[pid]
            for pid in [p for p in self.state.rank_gpus if p not in self.state.known]:
                del self.state.rank_gpus[pid]
            for gone in [p for p in self.state.agent_outputs if p not in agents]:
                # kept a while after its agent left the rounds: its ranks' exits may be told
                # after a round saw the job gone (the connector's reader runs on its own
                # thread; after a stall, or lost events, the round can come first)
                if now - self._agents_seen.get(gone, 0) < AGENT_GRACE_NS:
                    continue
                if not any(inc.gen.agent_pid == gone for inc in self.state.incidents.values()):
                    del self.state.agent_outputs[gone]
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
            known_files = [f for files in self.state.agent_outputs.values() for f in files]
        # Outside the lock (file system calls), once per new job, rank and cgroup
        outputs, rank_files, marks = self.gather.newcomers(new_agents, new_ranks, new_cgroups, known_files)
        found = {a: self.gather.run_spool(a, path, uid) for a, (path, uid) in spools.items()}
        with self.state.cv:
            for agent, spool in found.items():
                if spool is None:
                    self._spool_tries[agent] = self._spool_tries.get(agent, 0) + 1
                    continue
                self._spool_tries[agent] = SPOOL_TRIES  # found: looked for no more
                files = outputs.get(agent) or self.state.agent_outputs.get(agent) or []
                outputs[agent] = [*files, spool]
                log.info(
                    "job of agent %d runs under trainwatch run: reading its output from %r", agent, spool.path
                )
            self.state.rank_files.update(rank_files)
            self.state.agent_outputs.update(outputs)
            self.state.oomd_baseline.update(marks)
            for job_key in [
                k
                for k, inc in self.state.incidents.items()
                if inc.due_ns is None and now - inc.last_death_ns > INCIDENT_QUIET_S * 1e9
            ]:
                del self.state.incidents[job_key]
        self.save_journal(now)

    def on_exit(self, event: ExitEvent) -> None:
        """Connector or pidfd thread (or the sampler's zombie fallback): a process exited."""
        with self.state.cv:
            self.state.reported[event.pid] = event.monotonic_ns
            self._ended(event.pid, event.exit_code, event.monotonic_ns, event.source)

    def on_unknown(self, pid: int, monotonic_ns: int) -> None:
        """A watched process ended and nobody could tell its exit status (pidfd after the
        reap on an old kernel, or the sampler found it gone)."""
        with self.state.cv:
            if pid in self.state.reported:
                return  # its status came another way
            self.state.reported[pid] = monotonic_ns
            self._ended(pid, None, monotonic_ns, None)

    def _ended(self, pid: int, exit_code: int | None, at_ns: int, source: str | None) -> None:
        known = self.state.known.get(pid)
        if known is None:
            for open_inc in self.state.incidents.values():
                if open_inc.gen.agent_pid == pid and open_inc.agent_exit is None:
                    open_inc.agent_exit = (exit_code, at_ns)
                    self.state.schedule(open_inc, at_ns)
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
        with self.state.cv:
            for pid, known in list(self.state.known.items()):
                if pid in self.state.reported or any(
                    pid in inc.deaths for inc in self.state.incidents.values()
                ):
                    continue
                if not self.gather.alive(known.sample.key, proc_root):
                    log.warning(
                        "job %s: rank %s (pid %d) vanished while exit events were lost; exit status unknown",
                        known.gen.job,
                        known.sample.rank_label,
                        pid,
                    )
                    self.state.reported[pid] = now  # told now: a later overrun does not tell it again
                    self._record(known, pid, None, now, None)

    def _record(self, known: Known, pid: int, exit_code: int | None, at_ns: int, source: str | None) -> None:
        inc = self.state.incidents.get(known.gen)
        if inc is None:
            if exit_code == 0:
                # a clean exit opens no incident, but is remembered: a sibling's death that
                # opens one later must not count this rank as still running
                self.state.clean_exits[pid] = (at_ns, source)
                return
            inc = self._open(known, pid, exit_code, at_ns)
        if pid in inc.deaths:
            return
        inc.deaths[pid] = (exit_code, at_ns, source)
        inc.last_death_ns = max(inc.last_death_ns, at_ns)
        wait = UNKNOWN_EXIT_WAIT_S if all(d[0] is None for d in inc.deaths.values()) else 0.0
        self.state.schedule(inc, at_ns + int(wait * 1e9))

    def on_signal(self, event: SignalEvent) -> None:
        """Tracepoint thread: keep the signals sent to ranks and to their agents (an agent
        signalled from outside tears its ranks down); the rest is not evidence."""
        if event.signal not in ENDING_SIGNALS:
            return  # the tracepoint's filter passes only these; a caller may not have one
        if event.target_pid not in self.state.known and event.target_pid not in self._agents():
            return
        sender = None
        if not event.from_kernel and event.sender_pid != event.target_pid:
            # read now, outside the lock: a `kill` is gone within milliseconds
            sender = self.gather.sender(event.sender_pid, event.sender_comm)
        with self.state.cv:
            if event.target_pid not in self.state.known and event.target_pid not in self._agents():
                return
            self.state.records.signal(event, sender)

    def _agents(self) -> set[int]:
        """The agents of the ranks known (a copy: read from the tracepoint's thread too)."""
        return {k.gen.agent_pid for k in list(self.state.known.values())}

    def on_kmsg(self, record: KmsgRecord) -> None:
        """Kernel-log thread: keep the OOM records (merged per pid), the NVRM Xids, and the
        lines Meta's oomd writes into the kernel log from user space."""
        parsed = Records.parse(record)
        if parsed is None:
            return
        with self.state.cv:
            touched = self.state.records.add(parsed)
            if touched is None:
                return
            for inc in self.state.incidents.values():
                if inc.deaths and (touched == EVERY_INCIDENT or touched in inc.deaths):
                    self.state.schedule(inc, self.clock_ns())

    def on_stranded(self, job: str, restart: int, pids: dict[int, float]) -> None:
        """Sampler thread: ranks of ``job`` alive and making no progress after a death
        (pid -> since, wall): their fate in the death's postmortem, rewritten now."""
        with self.state.cv:
            for inc in self.state.incidents.values():
                if inc.gen.job != job or inc.gen.restart != restart:
                    continue
                fresh = {p: t for p, t in pids.items() if p in inc.ranks and p not in inc.stranded}
                if fresh:
                    inc.stranded.update(fresh)
                    if inc.doc_id is not None:  # else the first write has them
                        self.state.schedule(inc, self.clock_ns())

    def on_kmsg_loss(self, count: int, timestamp_us: int) -> None:
        """Kernel-log thread: records were overwritten unread (an overrun): a death near
        them may lack the record that would explain it."""
        with self.state.cv:
            self.state.records.kmsg_losses.append((timestamp_us * 1000, count))
            for inc in self.state.incidents.values():
                if inc.deaths:
                    self.state.schedule(inc, self.clock_ns())

    def _open(self, known: Known, pid: int, exit_code: int | None, at_ns: int) -> Incident:
        ranks = {rank_pid: k for rank_pid, k in self.state.known.items() if k.gen == known.gen}
        # The memory "at death" is the last snapshot that saw the victim alive (a snapshot
        # can be published just after the death it predates, so not "the last one before").
        rounds = list(self.state.snapshots)
        seen = next(
            (
                i
                for i in range(len(rounds) - 1, -1, -1)
                if any(r.key.pid == pid for j in rounds[i][1].jobs for r in j.ranks)
            ),
            None,
        )
        if seen is None:
            seen = next((i for i in range(len(rounds) - 1, -1, -1) if rounds[i][0] <= at_ns), None)
        before = rounds[seen][1] if seen is not None else None
        inc = Incident(known.gen, ranks, snapshot_before=before)
        for rank_pid in ranks:
            if rank_pid in self.state.clean_exits:  # siblings that had already ended cleanly
                ns, source = self.state.clean_exits.pop(rank_pid)
                inc.deaths[rank_pid] = (0, ns, source)
        if seen is not None:
            counted = _counters_before(rounds, seen)
            hosts = [s.host.oom_kills for s in counted if s.host is not None and s.host.oom_kills is not None]
            inc.host_oom_before = min(hosts, default=None)
            inc.cgroup_oom_before = _earliest(counted, lambda c: c.oom_kills)
            inc.cgroup_hits_before = _earliest(counted, lambda c: c.limit_hits)
        self.state.incidents[known.gen] = inc
        log.warning(
            "job %s: rank %s (pid %d) died (%s, told %.0f ms later); writing a postmortem",
            known.gen.job,
            known.sample.rank_label,
            pid,
            _exit_text(exit_code),
            max(0, self.clock_ns() - at_ns) / 1e6,
        )
        return inc


def _counters_before(rounds: list[tuple[int, Snapshot]], seen: int) -> list[Snapshot]:
    """The rounds whose OOM counters stand for "before the death": from the newest round
    observed at least ``COUNTERS_MARGIN_NS`` before the last one that saw the victim (else the
    oldest kept) up to that one. The kernel counts an OOM kill before its victim exits, and a
    round can list a victim that is still exiting (its pid read before, its counters after the
    kill): that round's counters may already hold the kill, so an earlier round's stand too."""
    seen_ns = rounds[seen][0]
    first = next((i for i in range(seen, -1, -1) if rounds[i][0] <= seen_ns - COUNTERS_MARGIN_NS), 0)
    return [s for _, s in rounds[first : seen + 1]]


def _earliest(rounds: list[Snapshot], value: Callable[[CgroupSample], int | None]) -> dict[str, int]:
    """Each cgroup's lowest count over ``rounds`` (the counters only grow: the earliest read)."""
    out: dict[str, int] = {}
    for snap in rounds:
        for c in snap.cgroups:
            v = value(c)
            if v is not None:
                out[c.path] = min(v, out.get(c.path, v))
    return out


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    status, sig = decode_wait_status(code)
    return f"signal {signal_name(sig)}" if sig is not None else f"exit status {status}"
