"""What the torchrun agent (torch.distributed.elastic) says about its workers.

Pure: text in, typed records out. The agent's logger prefix changed over the years, so
the records are found by their message, wherever a line starts (EVIDENCE.md §7, the
public logs and the device captures):

* 1.9-2.0 ``WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 812914
  closing signal SIGTERM`` and ``ERROR:torch...api:failed (exitcode: -9) local_rank: 3
  (pid: 812917) of binary: /usr/bin/python``;
* 2.1-2.3 ``[2024-01-01 10:00:00,123] torch.distributed.elastic.multiprocessing.api:
  [WARNING] Sending process ...``;
* 2.4+ glog style ``W1202 11:52:51.136000 551 torch/distributed/elastic/multiprocessing/
  api.py:1012] Sending process 576 closing signal SIGTERM``, then ``Unable to shutdown
  process 576 via 15, forcefully exiting via 9``;
* the failure table of ``ChildFailedError`` (every generation; terminal wrapping and
  copy-paste can glue its lines together)::

      [1]:
        time      : 2026-12-02_11:53:21
        host      : localhost
        rank      : 0 (local_rank: 0)
        exitcode  : -9 (pid: 576)
        error_file: <N/A>
        traceback : Signal 9 (SIGKILL) received by PID 576

``exitcode`` is what torchrun prints: -N for a death by signal N, else the exit status.
"""

from __future__ import annotations

import json
import re
import signal as _signal
from dataclasses import dataclass

__all__ = [
    "AgentRecord",
    "ClosingSignal",
    "DeathSignal",
    "ErrorFile",
    "Escalation",
    "FailureEntry",
    "WorkerFailed",
    "exit_codes_by_pid",
    "parse_agent_text",
    "parse_error_file",
]


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """``failed (exitcode: -9) local_rank: 3 (pid: 812917) of binary: ...``: the first
    failure the agent noticed (not necessarily the first death)."""

    exitcode: int
    local_rank: int
    pid: int
    line: str


@dataclass(frozen=True, slots=True)
class ClosingSignal:
    """``Sending process N closing signal SIGTERM``: the agent tears a worker down."""

    pid: int
    signal: int | None
    line: str


@dataclass(frozen=True, slots=True)
class Escalation:
    """``Unable to shutdown process N via 15, forcefully exiting via 9``."""

    pid: int
    from_signal: int
    to_signal: int
    line: str


@dataclass(frozen=True, slots=True)
class DeathSignal:
    """``Received 1 death signal, shutting down workers``: the agent itself was signalled."""

    signal: int | None
    line: str


@dataclass(frozen=True, slots=True)
class FailureEntry:
    """One entry of the ChildFailedError table. ``root_cause``: listed under "Root Cause
    (first observed failure)"."""

    rank: int | None
    local_rank: int | None
    exitcode: int
    pid: int
    error_file: str | None
    traceback: str | None
    root_cause: bool
    time: str | None


AgentRecord = WorkerFailed | ClosingSignal | Escalation | DeathSignal | FailureEntry

_FAILED = re.compile(r"failed \(exitcode: (-?\d{1,20})\) local_rank: (\d{1,20}) \(pid: (\d{1,20})\)")
_CLOSING = re.compile(r"Sending process (\d{1,20}) closing signal (SIG[A-Z0-9]+|\d+)")
_ESCALATE = re.compile(
    r"Unable to shutdown process (\d{1,20}) via (\d{1,20}), forcefully exiting via (\d{1,20})"
)
_DEATH = re.compile(r"Received (\S+) death signal, shutting down workers")
# The table's fields, tolerant of glued lines ("rank2 (local rank: 2)exitcode: -9 (pid: 36071)")
_ENTRY = re.compile(
    r"rank\s*:?\s*(?P<rank>\d{1,20})\s*\(local[ _]rank:\s*(?P<local>\d{1,20})\)"
    r"[\s\S]{0,80}?exitcode\s*:\s*(?P<code>-?\d{1,20})\s*\(pid:\s*(?P<pid>\d{1,20})\)"
    r"(?:[\s\S]{0,80}?error[ _]file\s*:\s*(?P<error_file>\S+))?"
    r"(?:[\s\S]{0,40}?traceback\s*:\s*(?P<traceback>[^\n]*))?"
)
_ENTRY_TIME = re.compile(r"time\s*:?\s*(\d{4}-\d{2}-\d{2}[_ ]\d{2}:\d{2}:\d{2})")
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\)\s*:")


def _signal_number(token: str) -> int | None:
    """A signal as the agent logs it: a number, a name, or the enum's repr that Python
    before 3.11 gave a ``signal.Signals`` in %s (``Signals.SIGTERM``)."""
    if token.isdigit():
        return int(token)
    try:
        return int(_signal.Signals[token.removeprefix("Signals.")])
    except KeyError:
        return None


def parse_agent_text(text: str) -> list[AgentRecord]:
    """Every agent record in ``text`` (a log, or a tail of one), in order."""
    records: list[tuple[int, AgentRecord]] = []
    for m in _FAILED.finditer(text):
        records.append((m.start(), WorkerFailed(int(m[1]), int(m[2]), int(m[3]), _line_at(text, m.start()))))
    for m in _CLOSING.finditer(text):
        records.append((m.start(), ClosingSignal(int(m[1]), _signal_number(m[2]), _line_at(text, m.start()))))
    for m in _ESCALATE.finditer(text):
        records.append((m.start(), Escalation(int(m[1]), int(m[2]), int(m[3]), _line_at(text, m.start()))))
    for m in _DEATH.finditer(text):
        records.append((m.start(), DeathSignal(_signal_number(m[1]), _line_at(text, m.start()))))
    roots = [m.end() for m in _ROOT_CAUSE.finditer(text)]
    for m in _ENTRY.finditer(text):
        # an entry is the root cause when the last "Root Cause" heading before it is
        # closer than the last "Failures:" heading (the table lists others first)
        heading = max((r for r in roots if r <= m.start()), default=-1)
        other = text.rfind("Failures:", 0, m.start())
        before = text[max(0, m.start() - 200) : m.start()]
        stamp = _ENTRY_TIME.findall(before)
        traceback = (m["traceback"] or "").strip() or None
        records.append(
            (
                m.start(),
                FailureEntry(
                    int(m["rank"]),
                    int(m["local"]),
                    int(m["code"]),
                    int(m["pid"]),
                    m["error_file"],
                    traceback,
                    heading > other,
                    stamp[-1] if stamp else None,
                ),
            )
        )
    return [r for _, r in sorted(records, key=lambda item: item[0])]


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)].strip()


def exit_codes_by_pid(records: list[AgentRecord]) -> dict[int, tuple[int, str]]:
    """pid -> (torchrun exitcode, the line that says so), from failure lines and tables."""
    out: dict[int, tuple[int, str]] = {}
    for r in records:
        if isinstance(r, WorkerFailed):
            out[r.pid] = (r.exitcode, r.line)
        elif isinstance(r, FailureEntry):
            out.setdefault(
                r.pid,
                (
                    r.exitcode,
                    f"rank {r.rank} (local_rank {r.local_rank}) exitcode {r.exitcode} (pid {r.pid})",
                ),
            )
    return out


@dataclass(frozen=True, slots=True)
class ErrorFile:
    """A rank's ``TORCHELASTIC_ERROR_FILE``, written by ``@record`` (torch.distributed.
    elastic.multiprocessing.errors) when the entrypoint raised: ``{"message": {"message":
    "RuntimeError: ...", "extraInfo": {"py_callstack": "Traceback ...", "timestamp":
    "1796235841"}}}``; older writers and C++ handlers put a plain string in ``message``."""

    message: str
    traceback: str | None
    timestamp: int | None


def parse_error_file(text: str) -> ErrorFile:
    """Raises ValueError, with the reason, when ``text`` is not such a record."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or "message" not in data:
        raise ValueError("no 'message' key")
    body = data["message"]
    if isinstance(body, str):
        return ErrorFile(body, None, None)
    if not isinstance(body, dict) or not isinstance(body.get("message"), str):
        raise ValueError("'message' is neither a string nor an object with a string 'message'")
    found = body.get("extraInfo")
    extra: dict[str, object] = found if isinstance(found, dict) else {}
    stack = extra.get("py_callstack")
    raw = extra.get("timestamp")
    stamp = int(raw) if isinstance(raw, (str, int)) and str(raw).isdigit() else None
    return ErrorFile(body["message"], stack if isinstance(stack, str) else None, stamp)
