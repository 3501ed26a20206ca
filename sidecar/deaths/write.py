"""A death decided and written: the death watch's worker thread. When an incident falls
due it takes the round's plan under the lock, has the gatherer read the job's files outside
it (``gather.py``), joins the reads with the feeds' records into ``Evidence`` under the lock
(``incidents.py``), runs the autopsy, and writes the postmortem, rewriting it as the other
ranks' fates become known and when the agent exits. Nothing a round meets ends the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar import lognames
from sidecar.autopsy import Evidence, Verdict, autopsy
from sidecar.deaths.gather import Gatherer, warm
from sidecar.deaths.incidents import (
    Incident,
    Plan,
    Reads,
    clean_end,
    join_evidence,
    killers_of,
    plan_of,
)
from sidecar.deaths.parts import live_parts
from sidecar.deaths.state import UNKNOWN_EXIT_WAIT_S, Watched
from sidecar.model import Warned
from sidecar.model.ledger import DeathLedger
from sidecar.model.stall import StallSnapshot
from sidecar.postmortem import PostmortemStore, build, iso, make_id
from sidecar.sampling.timeline import Timeline

__all__ = ["TIMELINE_WINDOW_S", "Autopsies", "Sources"]

log = logging.getLogger(lognames.DEATHS)

TIMELINE_WINDOW_S = 300.0
RETRY_WRITE_NS = 5 * 10**9  # while a postmortem is in memory only, how often to write it again
SLOW_READS_MS = 200.0  # an autopsy round whose reads take longer says so in the log
WALL_STEP_S = 0.05  # the wall clock moved this far against the monotonic one: it was stepped


@dataclass(frozen=True, slots=True)
class Sources:
    """What the daemon learned at start about how deaths are heard, said once: exits come
    first-hand from the kernel (the process connector), and the kernel log is read
    (``kernel_catch_up`` hands on its records written until now; None: /dev/kmsg is not
    readable). Given to the worker when it starts, before any autopsy."""

    exits_first_hand: bool = False
    kernel_catch_up: Callable[[], None] | None = None

    @property
    def kernel_log_readable(self) -> bool:
        return self.kernel_catch_up is not None


class Autopsies:
    """The worker: autopsies as incidents fall due, their postmortems, and the deaths counted
    (``ledger``, swapped whole: the scrape reads it without the lock). ``save_journal(now_ns)``:
    the journal's save, after a write."""

    def __init__(
        self,
        state: Watched,
        gather: Gatherer,
        store: PostmortemStore,
        timeline: Timeline,
        *,
        hostname: str,
        stall_of: Callable[[str], StallSnapshot | None] | None,
        warnings_of: Callable[[str], tuple[Warned, ...]],
        save_journal: Callable[[int], None],
        clock_ns: Callable[[], int],
        wall: Callable[[], float],
    ) -> None:
        self.state = state
        self.gather = gather
        self.store = store
        self.timeline = timeline
        self.hostname = hostname
        self.stall_of = stall_of  # the snapshot taken when the job stalled (stalls/tracker.py)
        self.warnings_of = warnings_of  # what foresight predicted for a job (foresight.py)
        self.save_journal = save_journal
        self.clock_ns = clock_ns
        self.wall = wall
        self.sources = Sources()
        self.ledger = DeathLedger()
        self._wall_offset: float | None = None  # wall minus monotonic seconds (wall_of)
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The thread this runs on, once started (for its priority)."""
        return self._thread

    def start(self, sources: Sources) -> None:
        self.sources = sources
        self._thread = threading.Thread(target=self._run, name="trainwatch-deaths", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the postmortems in flight, then stop."""
        with self.state.cv:
            self._stop = True
            self.state.cv.notify()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _run(self) -> None:
        warm()
        while True:
            if self.store.unwritten:
                self.store.retry()
            with self.state.cv:
                ready = []
                while True:
                    due = [inc for inc in self.state.incidents.values() if inc.due_ns is not None]
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
                        if not self.state.cv.wait(wait / 1e9):
                            break  # timed out: retry the writes below
                        continue
                    self.state.cv.wait(None if wait is None else wait / 1e9)
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
            # The kernel's OOM report precedes its SIGKILL: read the log up to now first, so a
            # round never judges a kill whose record the reader's thread has yet to hand on.
            try:
                if self.sources.kernel_catch_up is not None:
                    self.sources.kernel_catch_up()
            except Exception:
                log.exception("kernel log: catching up failed")
            reads = []
            for inc, plan in plans:
                started = time.perf_counter()
                try:
                    reads.append((inc, self.gather.read(inc, plan)))
                except Exception:
                    log.exception("job %s: reading the job's files failed; writing without them", inc.gen.job)
                    reads.append((inc, Reads.nothing()))
                self._took(inc, started, late.get(id(inc), 0.0))
            with self.state.cv:
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
        return plan_of(inc, self.state.agent_outputs, self.state.rank_files, self.state.oomd_baseline)

    def _stall(self, inc: Incident) -> dict[str, Any] | None:
        """The job's stall snapshot as the postmortem shows it, kept on the incident: the
        tracker forgets a job once it is gone."""
        if self.stall_of is not None and inc.stall is None:
            inc.stall = self.stall_of(inc.gen.job)
        return inc.stall.view(iso) if inc.stall is not None else None

    def _evidence(self, inc: Incident, reads: Reads) -> Evidence:
        """Under the lock: the round's reads joined with what the feeds recorded."""
        latest = self.state.latest()
        return join_evidence(
            inc,
            reads,
            self.state.records,
            latest=latest,
            rank_gpus=self.state.rank_gpus,
            kernel_log_readable=self.sources.kernel_log_readable,
            exits_first_hand=self.sources.exits_first_hand,
        )

    # -- the document --------------------------------------------------------------

    def wall_of(self, ns: int | None) -> float | None:
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
            clean = clean_end(
                inc, ev, verdict, readable_log=bool(self.state.agent_outputs.get(inc.gen.agent_pid))
            )
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
            # Undecided (the agent's exit or log may yet tell a clean end): wait for them,
            # unless this is the last round before the daemon stops. Rescheduled then, the
            # death would be due again at once, round after round (a core spun until the join
            # gave up) and its postmortem lost: it is written with what is known.
            waiting = self.clock_ns() - inc.last_death_ns < 4 * UNKNOWN_EXIT_WAIT_S * 1e9
            if clean is None and waiting and not self._stop:
                with self.state.cv:
                    self.state.schedule(inc, self.clock_ns() + int(UNKNOWN_EXIT_WAIT_S * 1e9))
                return
        first = inc.doc_id is None
        died_at = self.wall_of(verdict.victim.died_ns) or self.wall()
        if inc.doc_id is None:
            inc.doc_id = make_id(
                died_at, inc.gen.agent_pid, verdict.victim.label, self.hostname, inc.gen.restart
            )
            inc.created_at = self.wall()
        doc = self._document(inc, verdict, died_at, ev)
        self.store.put(doc, first=first)
        with self.state.cv:
            for r, killer in killers_of(verdict, ev):
                if r.pid in inc.counted:
                    continue
                inc.counted[r.pid] = killer
                when = self.wall_of(r.died_ns) or died_at
                self.ledger = self.ledger.counted((inc.gen.job, r.label, inc.gen.restart), killer, when)
        if first:
            log.warning(
                "job %s: postmortem %s: %s (%s)", inc.gen.job, inc.doc_id, verdict.summary, verdict.confidence
            )
        self.save_journal(self.clock_ns())

    def _document(self, inc: Incident, v: Verdict, died_at: float, ev: Evidence) -> dict[str, Any]:
        return build(
            live_parts(
                inc,
                v,
                died_at,
                ev,
                points=self.timeline.window(inc.gen.job, since=died_at - TIMELINE_WINDOW_S),
                wall_of=self.wall_of,
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
