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
NVML reported. ``remember.Memory`` keeps the watch's state across a restart. What they
share is ``state.Watched``, under one lock.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from sidecar.deaths.gather import Gatherer
from sidecar.deaths.hear import Feeds
from sidecar.deaths.journal import Journal
from sidecar.deaths.remember import Memory
from sidecar.deaths.saved import State
from sidecar.deaths.state import Watched
from sidecar.deaths.write import TIMELINE_WINDOW_S, Autopsies
from sidecar.model import Warned
from sidecar.model.events import SignalEvent
from sidecar.parse.kernel import KmsgRecord
from sidecar.postmortem import PostmortemStore
from sidecar.sampling.timeline import Timeline

__all__ = ["TIMELINE_WINDOW_S", "DeathWatch"]


class DeathWatch:
    """The feeds (``observe``, ``on_exit``, ``on_unknown``, ``resync``, ``on_signal``,
    ``on_kmsg``, ``on_kmsg_loss``, ``on_stranded``), the worker (``start``, ``stop``) and the journal
    (``restore``) of one node's deaths, sharing one state."""

    def __init__(
        self,
        store: PostmortemStore,
        timeline: Timeline,
        *,
        read_host_oom_kills: Callable[[], int | None] = lambda: None,
        read_cgroup_oom_kills: Callable[[str, int], int | None] = lambda path, version: None,
        read_cgroup_limit_hits: Callable[[str, int, str | None], int | None] = lambda path, version, by: None,
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
        self.gather = Gatherer(
            proc_root=proc_root,
            read_outputs=read_outputs,
            job_output=job_output,
            read_host_oom_kills=read_host_oom_kills,
            read_cgroup_oom_kills=read_cgroup_oom_kills,
            read_cgroup_limit_hits=read_cgroup_limit_hits,
            read_oomd_marks=read_oomd_marks,
            clock_ns=clock_ns,
            wall=wall,
        )
        self.state = Watched(clock_ns)
        self.memory = Memory(self.state, self.gather, timeline, journal, boot_id, clock_ns, wall)
        self.feeds = Feeds(self.state, self.gather, self.memory.save, clock_ns)
        self.autopsies = Autopsies(
            self.state,
            self.gather,
            store,
            timeline,
            hostname=hostname or socket.gethostname(),
            stall_of=stall_of,
            warnings_of=warnings_of,
            save_journal=self.memory.save,
            clock_ns=clock_ns,
            wall=wall,
        )
        # the feeds, as the daemon's watchers call them
        self.observe = self.feeds.observe
        self.on_exit = self.feeds.on_exit
        self.on_unknown = self.feeds.on_unknown
        self.resync = self.feeds.resync
        self.on_signal: Callable[[SignalEvent], None] = self.feeds.on_signal
        self.on_kmsg: Callable[[KmsgRecord], None] = self.feeds.on_kmsg
        self.on_kmsg_loss = self.feeds.on_kmsg_loss
        self.on_stranded = self.feeds.on_stranded
        self.restore: Callable[[State], int] = self.memory.restore
        self.start = self.autopsies.start
        self.stop = self.autopsies.stop

    # -- what the daemon sets and the scrape reads --------------------------------------

    @property
    def kernel_log_readable(self) -> bool:
        return self.autopsies.kernel_log_readable

    @kernel_log_readable.setter
    def kernel_log_readable(self, value: bool) -> None:
        self.autopsies.kernel_log_readable = value

    def reading_kernel_log(self, catch_up: Callable[[], None]) -> None:
        """The kernel log is read (its OOM records reach ``on_kmsg``); ``catch_up`` hands on
        the records written until now, called before each autopsy round."""
        self.autopsies.kernel_log_readable = True
        self.autopsies.kernel_catch_up = catch_up

    @property
    def exits_first_hand(self) -> bool:
        return self.autopsies.exits_first_hand

    @exits_first_hand.setter
    def exits_first_hand(self, value: bool) -> None:
        self.autopsies.exits_first_hand = value

    @property
    def deaths_total(self) -> dict[tuple[str, str], int]:
        return self.autopsies.deaths_total

    @property
    def death_times(self) -> dict[tuple[str, str, int], tuple[str, float]]:
        return self.autopsies.death_times

    @property
    def thread(self) -> threading.Thread | None:
        """The worker's thread, once started (for its priority)."""
        return self.autopsies.thread

    @property
    def journal(self) -> Journal | None:
        return self.memory.journal

    @property
    def boot_id(self) -> str:
        return self.memory.boot_id
