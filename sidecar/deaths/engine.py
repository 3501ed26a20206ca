"""Deaths, live: exit events and kernel log records in, postmortems out; the death watch
the daemon holds, put together from the rooms of a death's flow.

The sampler tells this room which processes are ranks (``observe``, every round); the
process connector reports exits (``on_exit``) and the kernel log its OOM records
(``on_kmsg``), each from its own thread: they are heard by ``hear.Feeds``. The first
abnormal death of a rank opens an *incident* for its job; the worker (``write.Autopsies``)
runs the autopsy a quarter of a second later (time for the kernel's records to arrive,
well inside the 1 s budget), writes the postmortem, and rewrites it as the other ranks'
fates become known and when the agent exits. The sampler is never blocked: all of this
happens on the worker thread. No room reads a file itself: ``gather.Gatherer`` does,
outside the lock, and ``records.Records`` keeps what the kernel log, the tracepoint and
NVML reported. ``remember.JournalKeeper`` keeps the watch's state across a restart. What they
share is ``state.Watched``, under one lock.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from sidecar.deaths.gather import Gatherer
from sidecar.deaths.hear import Feeds
from sidecar.deaths.journal import Journal
from sidecar.deaths.remember import JournalKeeper
from sidecar.deaths.saved import SavedState
from sidecar.deaths.state import Watched
from sidecar.deaths.write import TIMELINE_WINDOW_S, Autopsies, Sources
from sidecar.model import Snapshot, Warned
from sidecar.model.events import ExitEvent, SignalEvent
from sidecar.model.ledger import DeathLedger
from sidecar.model.stall import StallSnapshot
from sidecar.parse.kernel import KmsgRecord
from sidecar.postmortem import PostmortemStore
from sidecar.sampling.timeline import Timeline

__all__ = ["TIMELINE_WINDOW_S", "DeathWatch", "Sources"]


class DeathWatch:
    """One node's deaths: the feeds the sampler and the watchers call, the worker that writes
    postmortems (``start``, ``stop``) and the journal (``restore``), sharing one state.

    ``gather`` is the one door to files after a death (the daemon builds it with the
    counters' readers); ``stall_of`` and ``warnings_of`` say what the stall tracker and
    foresight knew of a job; ``journal`` and ``boot_id`` keep the watch across a restart.
    ``state`` (what the rooms share, under its lock) and ``autopsies`` (the worker) are there
    for a test to look inside; the daemon uses the methods."""

    def __init__(
        self,
        store: PostmortemStore,
        timeline: Timeline,
        gather: Gatherer,
        *,
        stall_of: Callable[[str], StallSnapshot | None] | None = None,
        warnings_of: Callable[[str], tuple[Warned, ...]] = lambda job: (),
        hostname: str | None = None,
        journal: Journal | None = None,
        boot_id: str | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.state = Watched(clock_ns)
        self._keeper = JournalKeeper(self.state, gather, timeline, journal, boot_id, clock_ns, wall)
        self._feeds = Feeds(self.state, gather, self._keeper.save, clock_ns)
        self.autopsies = Autopsies(
            self.state,
            gather,
            store,
            timeline,
            hostname=hostname or socket.gethostname(),
            stall_of=stall_of,
            warnings_of=warnings_of,
            save_journal=self._keeper.save,
            clock_ns=clock_ns,
            wall=wall,
        )

    # -- the feeds: what the sampler and the watchers tell, on their own threads ----------

    def observe(self, snap: Snapshot) -> None:
        """The sampler's round: which processes are ranks now, and their last figures."""
        self._feeds.observe(snap)

    def on_exit(self, event: ExitEvent) -> None:
        """A process exited (the connector, a pidfd or a zombie told its status)."""
        self._feeds.on_exit(event)

    def on_unknown(self, pid: int, monotonic_ns: int) -> None:
        """A process is gone and nothing told its status."""
        self._feeds.on_unknown(pid, monotonic_ns)

    def resync(self, proc_root: str = "/proc") -> None:
        """Exit events were lost (the connector's buffer overran): find the ranks gone."""
        self._feeds.resync(proc_root)

    def on_signal(self, event: SignalEvent) -> None:
        """The tracepoint saw an ending signal generated for a process."""
        self._feeds.on_signal(event)

    def on_kmsg(self, record: KmsgRecord) -> None:
        """A kernel log record (OOM reports, faults, Xid)."""
        self._feeds.on_kmsg(record)

    def on_kmsg_loss(self, count: int, timestamp_us: int) -> None:
        """The kernel's ring overwrote records before they were read."""
        self._feeds.on_kmsg_loss(count, timestamp_us)

    def on_stranded(self, job: str, restart: int, pids: dict[int, float]) -> None:
        """The strand tracker found survivors of a death going nowhere."""
        self._feeds.on_stranded(job, restart, pids)

    # -- the worker and the journal ------------------------------------------------------

    def start(self, sources: Sources | None = None) -> None:
        """Start the worker, told once how deaths are heard on this node (by default, by
        nothing first-hand: a zombie's status, the agent's log, the counters)."""
        self.autopsies.start(sources if sources is not None else Sources())

    def stop(self) -> None:
        """Finish the postmortems in flight, then stop the worker."""
        self.autopsies.stop()

    def restore(self, state: SavedState) -> int:
        """What an earlier run watched (its journal): the jobs with deaths while it was down."""
        return self._keeper.restore(state)

    # -- what the daemon and the scrape read ---------------------------------------------

    @property
    def ledger(self) -> DeathLedger:
        """The deaths counted so far: immutable, swapped whole by the worker."""
        return self.autopsies.ledger

    @property
    def thread(self) -> threading.Thread | None:
        """The worker's thread, once started (for its priority)."""
        return self.autopsies.thread

    @property
    def journal(self) -> Journal | None:
        return self._keeper.journal

    @property
    def boot_id(self) -> str:
        return self._keeper.boot_id
