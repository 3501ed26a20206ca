"""Finding distributed jobs and their ranks in /proc, incrementally (the whole of it, with
every launcher's mechanism: docs/architecture.md, "Finding jobs").

Every tick reads ``stat`` of *new* pids only (parent, start time, comm). A new process is an
**agent** (the job's launching process) when its comm is ``pt_elastic`` or its argv is a known
launch form (``jobs.launcher_of_argv``); a **rank** when its parent is an agent and its
environment is a worker's of that launcher (``jobs.is_worker``; a child caught between fork
and exec is retried); known by its **children** (``children.py``: spawn's and Lightning's);
part of a rank's **tree** when it descends from one (a walk of parent links); or anything
else, re-checked every tick while young and every few seconds after through its comm (a
change means an exec: a shell that later ``exec``s torchrun is still found).

Where the process connector works (``listen``, called by the daemon), /proc is listed only
every ``RESCAN_SECONDS`` (and after the connector lost events): between rescans the kernel
tells what changed, filtered to what is watched (``watch/procfilter.py``). A process is pid +
start time; the sampler tells discovery when a watched process is reparented or gone
(``reparent``, ``forget``) and asks it what it saw (``seen``, ``tree_of``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sidecar import lognames
from sidecar.errors import AccessDenied, NoSuchProcess, ParseError, ProbeError
from sidecar.model import ProcKey, RankEnv
from sidecar.probes.proc import TICKS_PER_SECOND, ProcReader, entrypoint_of
from sidecar.redact import redact_argv
from sidecar.sampling import jobs
from sidecar.sampling.children import ByChildren, lightning_rank
from sidecar.sampling.jobs import TrackedJob, attach_rank, launcher_of_argv

__all__ = ["Discovery"]
log = logging.getLogger(lognames.DISCOVERY)

# How often /proc is listed when the connector tells what changes: DeepSpeed's launcher, known
# only by its command line, is found by a listing. A listing reads new pids' stat only (exec
# events instead: 7.4 % of a core at 1,400 processes/s against 0.17 %, overhead-ab-exec.json).
RESCAN_SECONDS = 1.0
PENDING_RANK_SECONDS = 30.0  # how long a child of an agent may take to exec before it is "other"
YOUNG_SECONDS = 10.0  # processes this young are re-checked every tick
RECHECK_SECONDS = 5.0  # older ones this often
# With the connector telling renames, an old process that execs a launcher naming itself
# pt_elastic is seen at once: the sweep of old processes (a stat each, a cost that grows with
# the node, not the job) is left for launchers that never do, and for reused pids.
RECHECK_WITH_EVENTS_SECONDS = 30.0


@dataclass(slots=True)
class _Entry:
    key: ProcKey
    ppid: int
    comm: str
    first_seen: float
    kind: str = "new"  # new | agent | rank | pending | spawned | other | kthread


class Discovery:
    """Tracks torchrun agents, their ranks and the ranks' process trees.

    ``pids``: when given, only agents whose pid (or an ancestor's pid) is in it are
    watched. ``clock`` is monotonic seconds, ``wall`` epoch seconds (tests fake both).
    """

    def __init__(
        self,
        reader: ProcReader,
        pids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        boot_time: float | None = None,
        uptime: Callable[[], float] = lambda: time.clock_gettime(time.CLOCK_BOOTTIME),
        marker: str | None = None,
    ) -> None:
        self.reader = reader
        self.only = frozenset(pids)
        # `trainwatch run`'s TRAINWATCH_RUN_OUTPUT: with ``pids``, a Slurm step is watched too
        # when its tasks carry it and are this process's user's (srun's tasks are slurmd's)
        self.marker = marker
        self.clock, self.wall = clock, wall
        self.boot_time = boot_time
        self.uptime = uptime  # seconds since boot, the clock of /proc/PID/stat's start time
        self.entries: dict[int, _Entry] = {}
        self.children: dict[int, set[int]] = {}
        self.jobs: dict[int, TrackedJob] = {}  # agent pid -> job
        self.unreadable: dict[ProcKey, str] = {}
        self._watched: set[int] = set()
        self._trees: dict[int, list[int]] = {}  # rank pid -> its tree, as of the last tick
        self._pending: set[int] = set()  # agent children waiting for their exec
        self._young: set[int] = set()  # "other" processes re-checked every tick
        self._next_sweep = 0.0  # when every older "other" process is re-checked
        self._self_pid = os.getpid()
        self._on_gone: Callable[[ProcKey], None] | None = None  # report_gone
        self._feed: Callable[[], tuple[list[tuple[str, int, int]], bool]] | None = None  # listen
        self._watch: Callable[[set[int]], None] | None = None
        self._next_rescan = 0.0
        self._rescan_soon = False
        self._told: set[int] = set()  # the set last given to watch()
        # Whether anything came, went or moved since the last tick (a scan, events, the
        # sampler's forget/reparent): else the trees and the job list stand as they are.
        self._dirty = True
        self._sorted: list[TrackedJob] = []
        self.rescans_total = 0
        self.by_children = ByChildren(self)  # spawn's and Lightning's jobs (children.py)

    def listen(
        self, feed: Callable[[], tuple[list[tuple[str, int, int]], bool]], watch: Callable[[set[int]], None]
    ) -> None:
        """The connector's events (``feed``: since the last call, and whether any were lost)
        and its filter (``watch``: the pids to hear of). Without: /proc listed every tick."""
        self._feed, self._watch = feed, watch

    def report_gone(self, to: Callable[[ProcKey], None]) -> None:
        """Tell ``to`` when an agent or a rank is gone: the exit fallback of last resort,
        where neither the process connector nor pidfds report exits."""
        self._on_gone = to

    @property
    def hears_changes(self) -> bool:
        """The connector tells every fork and exit of a watched process."""
        return self._feed is not None

    def tree_of(self, rank: int) -> list[int]:
        """The rank's tree (itself first), as of the last tick."""
        return self._trees.get(rank) or self.tree(rank)

    def seen(self, pid: int) -> tuple[ProcKey, int] | None:
        """A process as discovery last saw it: (its key, its parent), or None."""
        entry = self.entries.get(pid)
        return None if entry is None else (entry.key, entry.ppid)

    # -- the tick ---------------------------------------------------------------------

    def tick(self) -> list[TrackedJob]:
        """Update the view (from the connector's events, and /proc when it is time to list
        it) and return the live jobs (agent start order)."""
        now = self.clock()
        events, lost = self._feed() if self._feed is not None else ([], False)
        if self._feed is None or lost or self._rescan_soon or now >= self._next_rescan:
            self._rescan_soon = False
            self._next_rescan = now + RESCAN_SECONDS
            self._scan(now)
            self._dirty = True
        if events:
            self._apply(events, now)
            self._dirty = True
        if not (self._dirty or self._pending):
            return self._sorted  # nothing came, went or moved since the last tick
        self._dirty = False
        entries = self.entries
        for pid in list(self._pending):
            entry = entries.get(pid)
            if entry is not None and entry.kind == "pending":
                self._try_rank(entry, now)
            if entry is None or entry.kind != "pending":
                self._pending.discard(pid)
        self._trees = {r: self.tree(r) for job in self.jobs.values() for r in job.ranks}
        self._watched = {pid for tree in self._trees.values() for pid in tree}
        if self._watch is not None:
            told = self._watched | self._pending | {job.agent.pid for job in self.jobs.values()}
            if told != self._told:
                self._told = told
                self._watch(told)
        self._sorted = sorted(self.jobs.values(), key=lambda j: (j.agent.start_ticks, j.agent.pid))
        return self._sorted

    def _scan(self, now: float) -> None:
        """List /proc: forget what is gone, classify what is new, re-check the young."""
        self.rescans_total += 1
        current = set(self.reader.pids())
        gone = [p for p in self.entries if p not in current]
        # ranks before agents: a job whose agent and ranks ended together is not "orphaned"
        gone.sort(key=lambda p: self.entries[p].kind == "agent")
        for pid in gone:
            self.forget(pid)
        fresh: list[_Entry] = []
        for pid in current:
            if pid in self.entries:
                continue
            entry = self._add(pid, now)
            if entry is not None:
                fresh.append(entry)
        # Parents start before their children: classify in that order.
        fresh.sort(key=lambda e: (e.key.start_ticks, e.key.pid))
        for entry in fresh:
            self._classify(entry, now)
        entries = self.entries
        for pid in list(self._young):
            entry = entries.get(pid)
            if entry is None or entry.kind != "other" or self.age(entry) >= YOUNG_SECONDS:
                self._young.discard(pid)
            elif pid not in self._watched:
                self._recheck(entry, young=True)
        self.by_children.check()
        if now >= self._next_sweep:
            self._next_sweep = now + (RECHECK_SECONDS if self._feed is None else RECHECK_WITH_EVENTS_SECONDS)
            for entry in list(entries.values()):
                pid = entry.key.pid
                if entry.kind == "other" and pid not in self._watched and pid not in self._young:
                    self._recheck(entry, young=False)

    def _apply(self, events: list[tuple[str, int, int]], now: float) -> None:
        """The connector's events since the last tick, in the order they happened: a fork
        of a watched process, a process that named itself pt_elastic, a watched exit."""
        fresh: list[_Entry] = []
        gone: list[int] = []
        for kind, pid, _parent in events:
            entry = self.entries.get(pid)
            if kind == "exit":
                if entry is not None:
                    gone.append(pid)
            elif kind == "fork":
                if entry is None or pid in gone:
                    if pid in gone:  # the pid was recycled within the tick
                        gone.remove(pid)
                        self.forget(pid)
                    entry = self._add(pid, now)
                    if entry is not None:
                        fresh.append(entry)
            elif entry is None:  # "agent": renamed itself pt_elastic
                entry = self._add(pid, now)
                if entry is not None:
                    fresh.append(entry)
            elif entry.kind in ("new", "other"):
                self._recheck(entry, young=False)
        # ranks before agents, as in a scan
        gone.sort(key=lambda p: self.entries[p].kind == "agent" if p in self.entries else False)
        for pid in gone:
            self.forget(pid)
        fresh.sort(key=lambda e: (e.key.start_ticks, e.key.pid))
        for entry in fresh:
            if entry.key.pid in self.entries:
                self._classify(entry, now)

    def tree(self, pid: int) -> list[int]:
        """``pid`` and every known descendant, parents before children, but other ranks and
        theirs (a Lightning rank 0 is the parent of its job's other ranks)."""
        out = [pid]
        entries = self.entries
        i = 0
        while i < len(out):
            out.extend(
                c for c in self.children.get(out[i], ()) if (e := entries.get(c)) is None or e.kind != "rank"
            )
            i += 1
        return out

    # -- what the sampler tells us -------------------------------------------------------

    def reparent(self, pid: int, ppid: int) -> None:
        entry = self.entries.get(pid)
        if entry is None or entry.ppid == ppid:
            return
        self._dirty = True
        self._unlink(pid, entry.ppid)
        entry.ppid = ppid
        self.children.setdefault(ppid, set()).add(pid)

    def forget(self, pid: int) -> None:
        """The process is gone (or its pid now names another process)."""
        entry = self.entries.pop(pid, None)
        if entry is None:
            return
        self._dirty = True
        if self._on_gone is not None and entry.kind in ("agent", "rank"):
            self._on_gone(entry.key)
        self._unlink(pid, entry.ppid)
        self.unreadable.pop(entry.key, None)
        self._pending.discard(pid)
        self._young.discard(pid)
        self.by_children.forget(pid)
        if entry.kind == "agent":
            jobs.agent_gone(self.jobs, pid)
        elif entry.kind == "rank":
            jobs.rank_gone(self.jobs, entry.ppid, pid)

    # -- internals ----------------------------------------------------------------------

    def _unlink(self, pid: int, ppid: int) -> None:
        siblings = self.children.get(ppid)
        if siblings is not None:
            siblings.discard(pid)
            if not siblings:
                del self.children[ppid]

    def _add(self, pid: int, now: float) -> _Entry | None:
        try:
            st = self.reader.stat(pid)
        except NoSuchProcess:
            return None
        except ProbeError as exc:
            log.debug("pid %d: %s", pid, exc)
            return None
        entry = _Entry(st.key, st.ppid, st.comm, now)
        self.entries[pid] = entry
        self.children.setdefault(st.ppid, set()).add(pid)
        if pid == 2 or st.ppid == 2 or pid == self._self_pid:
            entry.kind = "kthread"
        elif st.state in ("Z", "X") and st.threads <= 1:  # unreaped, named pt_elastic still: no agent
            entry.kind = "other"  # (a Z leader with threads lives)
        return entry

    def _classify(self, entry: _Entry, now: float) -> None:
        if entry.kind != "new":
            return  # a kernel thread, or already taken as a rank by its agent
        parent = self.entries.get(entry.ppid)
        if parent is not None and parent.kind == "agent":
            job = self.jobs.get(entry.ppid)
            if job is None or job.launcher != jobs.SPAWN:
                self._make_pending(entry, now)
                return
            # a spawn job's parent: only its spawned children that join a group are ranks
        if parent is not None and parent.kind in ("rank", "pending", "spawned"):
            entry.kind = "other"  # part of a rank's tree (or a rank's to be); found by tree()
            return
        if entry.comm == jobs.AGENT_COMM:
            self.make_agent(entry, jobs.TORCHRUN)
            return
        argv = self._argv(entry)
        launcher = launcher_of_argv(argv)
        if launcher is not None:
            self.make_agent(entry, launcher)
            return
        if self.by_children.claim(entry, argv):
            return
        if entry.kind == "new":
            entry.kind = "other"
            if self.age(entry) < YOUNG_SECONDS:
                self._young.add(entry.key.pid)

    def age(self, entry: _Entry) -> float:
        """Seconds since the process started (not since discovery first saw it: at the
        daemon's start every process is new to it, few are young)."""
        return self.uptime() - entry.key.start_ticks / TICKS_PER_SECOND

    def _make_pending(self, entry: _Entry, now: float) -> None:
        entry.kind = "pending"
        self._try_rank(entry, now)
        if entry.kind == "pending":
            self._pending.add(entry.key.pid)

    def _argv(self, entry: _Entry) -> tuple[str, ...]:
        """The process's command line (empty when unreadable). An empty cmdline is not a
        kernel thread (those are known by their parent, kthreadd): a process in the middle
        of execve() reads empty between the switch to its new memory and the copy of its
        arguments. Taking that for a kernel thread once lost a torchrun agent for good
        (exec'd behind a wrapper while the CPUs were busy)."""
        try:
            return self.reader.cmdline(entry.key.pid)
        except ProbeError:
            return ()

    def _recheck(self, entry: _Entry, young: bool) -> None:
        """Has this process exec'd into an agent? Young processes get their argv read
        (a fork that has not exec'd yet has its parent's comm); old ones only when their
        comm changed."""
        try:
            st = self.reader.stat(entry.key.pid)
        except ProbeError:
            return
        if st.start_ticks != entry.key.start_ticks:
            self.forget(entry.key.pid)
            return
        if st.comm == entry.comm and not young:
            return
        changed = st.comm != entry.comm
        entry.comm = st.comm
        if st.comm == jobs.AGENT_COMM:
            self.make_agent(entry, jobs.TORCHRUN)
        elif changed or young:
            argv = self._argv(entry)
            launcher = launcher_of_argv(argv)
            if launcher is not None:
                self.make_agent(entry, launcher)
            else:
                self.by_children.claim(entry, argv)

    def _allowed(self, entry: _Entry) -> bool:
        """Whether the process is, or descends from, one of the pids watched (all without)."""
        return not self.only or jobs.descends_from(entry.key.pid, self.only, self._parent_of)

    def _parent_of(self, pid: int) -> int:  # one not listed since the last scan: its stat
        entry = self.entries.get(pid)
        return entry.ppid if entry is not None else self.reader.stat(pid).ppid

    def make_agent(self, entry: _Entry, launcher: str, nested: bool = False) -> None:
        # An agent inside another agent's tree (a pre-exec worker still named pt_elastic)
        # is not a new job, unless it is a launcher's child known to be one (``_nested``).
        parent = self.entries.get(entry.ppid)
        if not nested and parent is not None and parent.kind in ("agent", "rank", "pending", "spawned"):
            return
        by_marker = False
        if not self._allowed(entry):
            outer = self.jobs.get(entry.ppid)
            # run's own Slurm step if its tasks say so (_marked); a launcher one of them runs
            by_marker = bool(self.marker) and launcher == jobs.SLURM
            if not by_marker and not (nested and outer is not None and outer.by_marker):
                entry.kind = "kthread"  # never look at it again
                return
        entry.kind = "agent"
        try:
            argv = self.reader.cmdline(entry.key.pid)
        except ProbeError:
            argv = ()
        self.jobs[entry.key.pid] = TrackedJob(
            entry.key, argv, self._started_at(entry.key), launcher=launcher, by_marker=by_marker
        )
        log.info(
            "found %s %s pid %d: %s",
            launcher,
            "agent" if launcher == jobs.TORCHRUN else "launcher",
            entry.key.pid,
            " ".join(redact_argv(argv))[:300] or entry.comm,
        )
        if self._feed is not None:  # a child forked before the connector's filter knew the agent
            self._rescan_soon = True
        if launcher == jobs.SPAWN:
            return  # its ranks are its spawned children that join a group (children.py)
        # Children seen before their parent was known to be an agent.
        now = self.clock()
        for child_pid in sorted(self.children.get(entry.key.pid, ())):
            child = self.entries.get(child_pid)
            if child is not None and child.kind in ("new", "other"):
                self._young.discard(child_pid)
                self._make_pending(child, now)

    def _started_at(self, key: ProcKey) -> float:
        if self.boot_time is None:
            return self.wall()
        return self.boot_time + key.start_ticks / TICKS_PER_SECOND

    def _try_rank(self, entry: _Entry, now: float) -> None:
        job = self.jobs.get(entry.ppid)
        if job is None:
            entry.kind = "other"
            return
        pid = entry.key.pid
        if job.by_marker and not self._marked(pid):
            if now - entry.first_seen > PENDING_RANK_SECONDS:
                entry.kind = "other"  # not the run's (or never exec'd)
            return
        if job.launcher in jobs.OUTER and self._nested(entry):
            return
        try:
            env = jobs.launcher_env(job.launcher, self.reader.environ(pid))
        except AccessDenied:
            if entry.key not in self.unreadable:
                self.unreadable[entry.key] = "environ"
                log.warning(
                    "job %s: cannot read the environment of worker pid %d (permission denied): "
                    "its rank is inferred from start order; run trainwatch as root or as the "
                    "job's user (or grant CAP_SYS_PTRACE) to read RANK/LOCAL_RANK",
                    job.key or f"(agent {job.agent.pid})",
                    pid,
                )
            self._attach(job, entry, None)
            return
        except (NoSuchProcess, ParseError):
            return
        if jobs.is_worker(job.launcher, env):
            self._attach(job, entry, env)
        elif now - entry.first_seen > PENDING_RANK_SECONDS:
            entry.kind = "other"

    def _marked(self, pid: int) -> bool:
        """A task of `trainwatch run`'s own step: its environment carries the run's marker
        and it is this process's user's."""
        try:
            raw = self.reader.environ(pid)
            uid = self.reader.status(pid).uid
        except ProbeError:
            return False
        return raw.get("TRAINWATCH_RUN_OUTPUT") == self.marker and uid == os.getuid()

    def _nested(self, entry: _Entry) -> bool:
        """A launcher started by one that starts any program (``mpirun torchrun``, mpiexec's
        hydra_pmi_proxy) is a job of its own; a copy of its parent before its exec is not."""
        launcher = launcher_of_argv(argv := self._argv(entry))
        parent = self.jobs.get(entry.ppid)
        if launcher is None or (parent and launcher == parent.launcher and argv == parent.agent_argv):
            return False
        self._pending.discard(entry.key.pid)
        self.make_agent(entry, launcher, nested=True)
        return True

    def _attach(self, job: TrackedJob, entry: _Entry, env: RankEnv | None) -> None:
        entry.kind = "rank"
        try:
            entrypoint = entrypoint_of(self.reader.cmdline(entry.key.pid))
        except ProbeError:
            entrypoint = None
        source = None
        if job.launcher == jobs.LIGHTNING:  # its launching process is its rank 0
            env, source = (lightning_rank(env) if env is not None else None), "LOCAL_RANK"
            self.by_children.adopt_parent(job, env)
        attach_rank(job, self.jobs.values(), entry.key, env, entrypoint, self.wall(), given=source)
