"""What the offline path (``trainwatch diagnose``) reads from the logs' text, for the rules
of ``logs``: each rank the logs name (``LogRank``), the records of every input
(``LogRecords``) and the kernel's (``KernelRecords``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sidecar.autopsy.evidence import KernelOom, UserspaceKill
from sidecar.catalog import Hit
from sidecar.parse.jobs import JobRecord
from sidecar.parse.kernel import XidRecord
from sidecar.parse.logs import Dating, KernelLine
from sidecar.parse.ranks import Finding

__all__ = ["KernelRecords", "LogRank", "LogRecords"]


@dataclass(slots=True)
class LogRank:
    rank: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    returncode: int | None = None  # torchrun's: -N for signal N, else the exit status
    at: float | None = None  # epoch seconds, when a line gave it
    first: bool = False  # the agent's "Root Cause (first observed failure)", or its "failed" line
    torn_down: bool = False
    inferred_local: bool = False
    inferred_rank: bool = False
    lines: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.rank is not None:
            return str(self.rank)
        if self.local_rank is not None:
            return f"local{self.local_rank}"
        return f"pid{self.pid}" if self.pid is not None else "?"


@dataclass(slots=True)
class LogRecords:
    kinds: dict[str, list[str]]
    agent: list[Any]
    findings: list[tuple[str | None, Finding]]
    kernel: list[KernelLine]
    jobs: list[JobRecord]
    userspace: list[UserspaceKill]
    output_read: bool
    host: str | None = None
    userspace_at: list[float | None] = field(default_factory=list)  # each userspace kill's line time
    # catalog messages that decide alone, from the agent's, the kernel's, a shell's and the
    # schedulers' lines (a rank's own output is read into ``findings``), with each line's time
    said: list[tuple[Hit, float | None]] = field(default_factory=list)
    # their reports of a process's exit status or signal that name no killer (spawn's
    # "process 1 terminated with signal SIGSEGV", a container's "Exit Code: 137")
    exits: list[tuple[Hit, float | None]] = field(default_factory=list)
    # their lines that relay another process's abrupt death (the catalog's ``relays_death``)
    relayed: list[str] = field(default_factory=list)
    death_at: dict[str, float] = field(default_factory=dict)  # rank label -> its death, where known
    # the input each of ``findings`` was read from (its index), in step with it: the order of
    # lines within one input is the order they were written
    finding_inputs: list[int] = field(default_factory=list)
    dating: Dating = field(default_factory=Dating.at_now)  # how year-less stamps are dated


@dataclass(slots=True)
class KernelRecords:
    ooms: list[KernelOom]
    partial: list[tuple[str, KernelLine]]  # (constraint, line): summaries cut before the pid
    tasks: dict[int, tuple[int, str]]  # pid -> (rss in pages, comm) from the OOM report's table
    xids: list[tuple[KernelLine, XidRecord]]
    host_total: int | None
    oom_at: dict[int, float] = field(default_factory=dict)  # pid -> wall time of its kill line
    # the page size the report counted in, where it printed a count both in pages and in kB
    # (``diagnose.kernel.infer_page_size``); None when it cannot be told: the log may come from a
    # host with another page size than this one
    page_size: int | None = None

    def task_rss_bytes(self, pid: int | None) -> int | None:
        """A pid's RSS from the task table, in bytes; None when absent or the page size is
        not known."""
        row = self.tasks.get(pid) if pid is not None else None
        return row[0] * self.page_size if row is not None and self.page_size is not None else None
