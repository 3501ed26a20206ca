"""The reads an incident needs, done outside the death watch's lock: what the job printed
(the agent's and ranks' output files, ``trainwatch run``'s kept output, the ranks'
``TORCHELASTIC_ERROR_FILE`` records), the OOM counters after the death, userspace OOM
daemons and their logs and marks, the flight recorder's dumps and the job's /dev/shm. Each
read is parsed here into what ``deaths.DeathWatch`` joins into the autopsy's ``Evidence``.
The incident's data types are in ``incidents.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from sidecar import lognames, saferead
from sidecar.catalog import catalog
from sidecar.deaths.incidents import Incident, Plan, Reads
from sidecar.deaths.oomd import kill_lines, marked_kills, oom_daemons
from sidecar.model import ProcKey, wait_status_from_returncode
from sidecar.model.events import Sender
from sidecar.parse.flight import MAX_DUMP_BYTES, FlightDump, FlightVerdict, parse_dump, summarise
from sidecar.parse.pasted import plain_output
from sidecar.parse.ranks import Finding, parse_rank_output, stamp_to_epoch
from sidecar.parse.torchrun import (
    ClosingSignal,
    exit_codes_by_pid,
    parse_agent_text,
    parse_error_file,
)
from sidecar.probes.outputs import OutputFile, read_output, regular_outputs, run_spool
from sidecar.probes.proc import read_stat, still_alive
from sidecar.probes.senders import describe_sender

__all__ = ["OUTPUT_PARSE_BYTES", "Gatherer"]

log = logging.getLogger(lognames.DEATHS)

OUTPUT_PARSE_BYTES = 2 << 20  # of each output stream, the tail that is parsed at a death
ERROR_FILE_BYTES = 1 << 20
# What one autopsy round may spend on files a job named (each read also has its own
# deadline): with the quarter-second wait before it, a postmortem is out within ~1 s
# whatever the job put in its way.
READ_BUDGET_S = 0.6

# the channels of the job's logs that are not a rank's own words (the kernel's are read
# from the kernel log itself, records.py)
_JOB_LOG_CHANNELS = ("agent", "shell", "scheduler")


def warm() -> None:
    """Load the catalog and the readers an autopsy round uses, before any death: compiling
    the catalog's patterns takes about half a second, which the first round would otherwise
    spend out of its budget for reading the job's files (the worker's thread, at start)."""
    parse_rank_output(plain_output("[rank0]: warm"))
    job_log_said([(None, "warm")])


def job_log_said(texts: list[tuple[str | None, str]]) -> tuple[tuple[str, str], ...]:
    """The catalog's launcher, shell and scheduler messages that decide a death, in the
    job's output as read (the agent's stream and each rank's): (message id, line), the
    same part of the catalog diagnose reads these lines with. Each distinct line once."""
    part = catalog().part(*_JOB_LOG_CHANNELS, deciding=True)
    seen: set[str] = set()
    found: list[tuple[str, str]] = []
    for _, text in texts:
        for hits in part.scan_lines(plain_output(text).splitlines()):
            for hit in hits:
                if hit.line not in seen:
                    found.append((hit.message.id, hit.line))
            seen.update(hit.line for hit in hits)
    return tuple(found)


class Gatherer:
    """The file reads of one autopsy round, with what they need from the daemon."""

    def __init__(
        self,
        *,
        proc_root: str = "/proc",
        read_outputs: bool = True,
        job_output: Callable[[int], str] | None = None,
        read_host_oom_kills: Callable[[], int | None] = lambda: None,
        read_cgroup_oom_kills: Callable[[str, int], int | None] = lambda path, version: None,
        read_cgroup_limit_hits: Callable[[str, int, str | None], int | None] = lambda path, version, by: None,
        read_oomd_marks: Callable[[str, int], dict[str, int]] = lambda path, version: {},
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.proc_root = proc_root
        self.read_outputs = read_outputs
        self.job_output = job_output
        self.read_host_oom_kills = read_host_oom_kills
        self.read_cgroup_oom_kills = read_cgroup_oom_kills
        self.read_cgroup_limit_hits = read_cgroup_limit_hits
        self.read_oomd_marks = read_oomd_marks
        self.clock_ns = clock_ns
        self.wall = wall
        self.roots: dict[int, saferead.JobRoot] = {}  # agent pid -> its job's file-system root
        self._budget_end = 0.0
        self.timings: dict[str, float] = {}  # the last round's steps, ms

    def forget(self, agent_pid: int) -> None:
        root = self.roots.pop(agent_pid, None)
        if root is not None:
            root.close()

    def run_spool(self, agent_pid: int, path: str, uid: int | None) -> OutputFile | None:
        """Where ``trainwatch run`` keeps the job's output, if a process of the job holds it
        (probes/outputs.run_spool): the feeds ask here, the one door to the files."""
        return run_spool(self.proc_root, agent_pid, path, uid)

    def sender(self, pid: int, comm: str) -> Sender:
        """A signal's sender as /proc shows it now (probes/senders.describe_sender): read on
        the tracepoint's thread at once, since a ``kill`` is gone within milliseconds."""
        return describe_sender(self.proc_root, pid, comm)

    def _deadline(self) -> float:
        """The deadline of the next read of a job-named file: what is left of the round's
        budget, at most one read's own."""
        left = self._budget_end - time.monotonic()
        if left <= 0:
            raise saferead.Refused(f"the round's {READ_BUDGET_S:g} s for reading the job's files was spent")
        return min(saferead.DEFAULT_DEADLINE_S, left)

    def alive(self, key: ProcKey, proc_root: str | None = None) -> bool:
        """The process is still the one ``key`` names and not a zombie. Only a process that
        is gone reads as dead: one whose stat cannot be read (permission denied under a
        ``hidepid`` mount, an I/O error) cannot be told dead, and a death is never made up
        from an unreadable file (``resync`` and ``restore`` would judge it)."""
        root = proc_root or self.proc_root
        return still_alive(lambda pid: read_stat(root, pid), key, if_unreadable=True)

    def newcomers(
        self,
        agents: list[int],
        ranks: list[int],
        cgroups: list[tuple[str, int]],
        agent_files: list[OutputFile],
    ) -> tuple[
        dict[int, list[OutputFile]],
        dict[int, tuple[list[OutputFile], float]],
        dict[tuple[str, int], dict[str, int]],
    ]:
        """Read once per new agent, rank and cgroup, before anything died: where each agent
        writes (its log gives exit codes when nothing else does); each rank's own
        stdout/stderr where they are not an agent's (torchrun --redirects and --log-dir
        point them at per-rank files), with when it was first seen; the oomd marks each
        cgroup had. ``agent_files``: the known agents' files."""
        outputs = {p: regular_outputs(self.proc_root, p) if self.read_outputs else [] for p in agents}
        for p in agents:  # kept so that paths resolve in the job's mount namespace after it is gone
            if p not in self.roots:
                try:
                    self.roots[p] = saferead.JobRoot(self.proc_root, p)
                except OSError as exc:
                    log.info(
                        "agent %d: its root cannot be opened (%s); its ranks' files will not be read", p, exc
                    )
        marks = {key: self.read_oomd_marks(*key) for key in cgroups}
        rank_files: dict[int, tuple[list[OutputFile], float]] = {}
        if ranks:
            shared = {(f.device, f.inode) for f in agent_files}
            shared |= {(f.device, f.inode) for files in outputs.values() for f in files}
            seen_at = self.wall()
            for p in ranks:
                own = regular_outputs(self.proc_root, p) if self.read_outputs else []
                rank_files[p] = ([f for f in own if (f.device, f.inode) not in shared], seen_at)
        return outputs, rank_files, marks

    def read(self, inc: Incident, plan: Plan) -> Reads:
        """Outside the lock: every file this autopsy round reads, read and parsed. How
        long each step took is kept in ``timings`` (ms; the death watch logs a slow round)."""
        self._budget_end = time.monotonic() + READ_BUDGET_S
        steps: dict[str, float] = {}
        mark = time.perf_counter()

        def took(step: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            steps[step] = round((now - mark) * 1000, 1)
            mark = now

        skipped: list[str] = []
        texts = self._texts(inc, plan)
        took("outputs")
        errors = self._error_files(inc, plan, skipped)
        took("error files")
        codes, teardown = self._agent_log(inc, texts)
        findings = tuple(self._findings(inc, [(o, t, None) for o, t in texts] + errors))
        took("parse")
        job_said = job_log_said(texts)
        took("job logs")
        after_cg: dict[str, int] = {}
        hits_cg: dict[str, int] = {}
        # The cgroups the ranks were in may hold no live rank any more (so no snapshot
        # samples them): read their counters now.
        before = inc.snapshot_before
        for cg in before.cgroups if before else ():
            now = self.read_cgroup_oom_kills(cg.path, cg.version)
            if now is not None:
                after_cg[cg.path] = now
            hits = self.read_cgroup_limit_hits(cg.path, cg.version, cg.limited_by)
            if hits is not None:
                hits_cg[cg.path] = hits
        host_after = self.read_host_oom_kills()
        took("counters")
        flight, flight_on = self._flight(inc, plan, skipped)
        took("flight recorder")
        daemons = [
            (comm, pid, kill_lines(self.proc_root, comm, pid, self._deadline) if self.read_outputs else [])
            for comm, pid in oom_daemons(self.proc_root)
        ]
        oomd = marked_kills(inc.snapshot_before, plan.oomd_baseline, self.read_oomd_marks)
        took("oom daemons")
        shm = self._shm(inc)
        took("shm")
        self.timings = steps
        return Reads(
            texts + [(owner, text) for owner, text, _ in errors],
            codes,
            teardown,
            findings,
            after_cg,
            hits_cg,
            host_after,
            daemons,
            oomd,
            flight,
            flight_on,
            shm,
            tuple(skipped),
            job_said,
        )

    def _texts(self, inc: Incident, plan: Plan) -> list[tuple[str | None, str]]:
        """What the job printed that can be read: (the rank it belongs to, or None for
        the agent's stream that every rank shares too, text)."""
        texts: list[tuple[str | None, str]] = []
        if self.job_output is not None:
            texts.append((None, self.job_output(inc.gen.agent_pid)[-OUTPUT_PARSE_BYTES:]))
        if self.read_outputs:
            files: list[tuple[str | None, OutputFile]] = [(None, f) for f in plan.agent_files]
            files += [(label, f) for _, label, own in plan.rank_files for f in own]
            for owner, f in files:
                try:
                    deadline = self._deadline()
                except saferead.Refused:
                    break
                texts.append((owner, read_output(self.proc_root, f, OUTPUT_PARSE_BYTES, deadline_s=deadline)))
        return [(owner, text) for owner, text in texts if text]

    def _error_files(
        self, inc: Incident, plan: Plan, skipped: list[str]
    ) -> list[tuple[str | None, str, str | None]]:
        """The ranks' TORCHELASTIC_ERROR_FILE records (written where the entrypoint has
        ``@record``): (rank label, the traceback or message, the file). The path is the
        rank's: resolved in the job's mount namespace, and the file must be the rank's."""
        out: list[tuple[str | None, str, str | None]] = []
        root = self.roots.get(inc.gen.agent_pid)
        for label, path, uid in plan.error_files:
            try:
                if root is None:
                    raise saferead.Refused("the job's file system root could not be opened")
                if uid is None:
                    raise saferead.Refused("the rank's user is not known")
                got = saferead.read_job_file(
                    root, path, owner=uid, cap=ERROR_FILE_BYTES, deadline_s=self._deadline()
                )
            except FileNotFoundError:
                continue  # no exception was recorded
            except (OSError, saferead.Refused) as exc:
                skipped.append(f"error file {path} of rank {label} not read: {_why(exc)}")
                continue
            try:
                record = parse_error_file(got.data.decode("utf-8", "replace"))
            except ValueError as exc:
                skipped.append(f"error file {path} of rank {label} not used: {exc}")
                continue
            # the traceback gives the exception line and the collective it was in
            out.append((label, record.traceback or record.message, path))
        return out

    def _findings(
        self, inc: Incident, texts: list[tuple[str | None, str, str | None]]
    ) -> list[tuple[str | None, Finding]]:
        """The ranks' findings, attributed: a rank's own file, else the line's prefix.
        ``texts``: (owner, text, the error file it came from or None)."""
        by_rank = {
            k.sample.rank: k.sample.rank_label for k in inc.ranks.values() if k.sample.rank is not None
        }
        by_local = {
            k.sample.local_rank: k.sample.rank_label
            for k in inc.ranks.values()
            if k.sample.local_rank is not None
        }
        found: list[tuple[str | None, Finding]] = []
        seen: set[tuple[str | None, str, str]] = set()
        wall, mono = self.wall(), self.clock_ns()
        for owner, text, error_file in texts:
            # read as a paste is (colours, a progress bar's carriage returns, a runtime's or
            # srun's prefixes), never rejoined: a file holds the lines the process wrote
            found_here = parse_rank_output(text if error_file is not None else plain_output(text))
            if error_file is not None and not any(f.kind == "exception" for f in found_here):
                kind, _, message = text.strip().partition(": ")  # a message without its traceback
                found_here.append(
                    Finding("exception", None, None, text.strip(), (("type", kind), ("message", message)))
                )
            for f in found_here:
                if error_file is not None:
                    f = replace(f, fields=(*f.fields, ("file", error_file)))
                epoch = stamp_to_epoch(f.stamp, wall) if f.stamp is not None else None
                if epoch is not None:  # the line's own time, on this clock
                    f = replace(f, at_ns=mono - int((wall - epoch) * 1e9))
                label = owner
                if label is None and f.rank is not None:
                    label = by_rank.get(f.rank)
                if label is None and f.local_rank is not None:
                    label = by_local.get(f.local_rank)
                if (label, f.kind, f.line) not in seen:
                    seen.add((label, f.kind, f.line))
                    found.append((label, f))
        return found

    def _flight(
        self, inc: Incident, plan: Plan, skipped: list[str]
    ) -> tuple[FlightVerdict | None, bool | None]:
        """The flight recorder's dumps of this generation's ranks: the verdict, and whether
        the recorder was on (None: no rank's environment could be read)."""
        envs = {pid: k.sample.flight_recorder for pid, k in inc.ranks.items()}
        known = [e for e in envs.values() if e is not None]
        if not known:
            return None, None
        dumps: list[FlightDump] = []
        world: list[int] = []
        for pid, env in envs.items():
            rank = inc.ranks[pid].sample.rank
            if env is None or env[0] <= 0 or rank is None:
                continue
            world.append(rank)
            path = f"{env[1]}{rank}"
            root, uid = self.roots.get(inc.gen.agent_pid), inc.ranks[pid].sample.uid
            try:
                if root is None or uid is None:
                    raise saferead.Refused("the job's root or the rank's user is not known")
                got = saferead.read_job_file(
                    root, path, owner=uid, cap=MAX_DUMP_BYTES, deadline_s=self._deadline()
                )
                if got.mtime < plan.seen_at.get(pid, 0.0) - 60:
                    continue  # an earlier run's dump
                dumps.append(parse_dump(got.data, rank, path))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, saferead.Refused) as exc:
                skipped.append(f"flight-recorder dump {path} of rank {rank} not used: {_why(exc)}")
        on = any(buffer > 0 for buffer, _ in known)
        return (summarise(dumps, tuple(sorted(world))) if dumps else None), on

    def _shm(self, inc: Incident) -> tuple[int, int, float | None] | None:
        """/dev/shm as the job sees it (its own mount namespace: a container's, or a
        private tmpfs): (size, used) bytes and how long before the first death it was read
        (None: read now, through a live process of the job). Read once (the later rewrites
        of the postmortem find the job gone). A job torn down before this round is read as
        the sampler last saw it."""
        if inc.shm is not None:
            return inc.shm
        for pid in [*inc.ranks, inc.gen.agent_pid]:
            try:
                st = saferead.statvfs_in_root(self.proc_root, pid, "/dev/shm")
            except (OSError, saferead.Refused):
                continue
            inc.shm = st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize, None
            return inc.shm
        before = inc.snapshot_before
        sampled = next((j.shm for j in before.jobs if j.key == inc.gen.job), None) if before else None
        if sampled is not None:
            size, used, at = sampled
            first = min((ns for _, ns, _ in inc.deaths.values()), default=None)
            inc.shm = size, used, None if first is None else max(0.0, first / 1e9 - at)
        return inc.shm

    def _agent_log(
        self, inc: Incident, texts: list[tuple[str | None, str]]
    ) -> tuple[dict[int, tuple[int, str]], frozenset[int]]:
        """From the agent's output, where it can be read: pid -> (wait status, the agent's
        line), and the pids it sent closing signals to."""
        codes: dict[int, tuple[int, str]] = {}
        teardown: set[int] = set()
        for _, text in (t for t in texts if t[0] is None):
            records = parse_agent_text(text)
            for pid, (rc, line) in exit_codes_by_pid(records).items():
                codes.setdefault(pid, (wait_status_from_returncode(rc), line))
            teardown.update(r.pid for r in records if isinstance(r, ClosingSignal))
        return codes, frozenset(teardown & set(inc.ranks))


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc)
