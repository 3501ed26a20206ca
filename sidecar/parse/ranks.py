"""What ranks write before they die: collective timeouts, CUDA OOM, DataLoader and shared
memory failures, Python exceptions. Pure: text in, typed findings out.

Lines are attributed to a rank by their prefix where there is one: torch 2.x prefixes a
rank's uncaught traceback and its C++ log lines with ``[rankN]:`` (global rank); torchrun
``--tee``/``--redirects`` prefix every line with ``[defaultN]:`` (role + local rank); the
NCCL watchdog says ``[Rank N]`` itself. Formats (EVIDENCE.md §8, the device captures and
public logs):

* NCCL watchdog, 1.x to 2.x: ``Watchdog caught collective operation timeout:
  WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576,
  Timeout(ms)=5000) ran for 5049 milliseconds before timing out.`` (no Numel before 1.13),
  ``last enqueued work: 2, last completed work: 1`` (or ``Last enqueued NCCL work``),
  ``NCCL communicator was aborted``, the heartbeat monitor's ``watchdog got stuck`` /
  ``Heartbeat monitor timed out``;
* gloo: ``[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv
  operation to complete`` and ``Connection closed by peer [127.0.0.1]:16814``;
* CUDA OOM: ``CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total
  capacity; ...)`` (before 2.1) and ``... Tried to allocate 20.00 GiB. GPU 0 has a total
  capacity of 79.10 GiB of which 5.00 GiB is free.``;
* DataLoader: ``DataLoader worker (pid 1234) is killed by signal: Bus error.`` and
  ``ERROR: Unexpected bus error encountered in worker. This might be caused by
  insufficient shared memory (shm).``;
* a traceback's last line: ``ValueError: message``; frames in ``distributed_c10d.py`` name
  the collective (``in all_reduce``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace

from sidecar.catalog import Hit, Message, catalog
from sidecar.model import Kind

__all__ = ["Finding", "line_stamp", "parse_rank_output", "said_fields", "size_to_bytes", "stamp_to_epoch"]

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def size_to_bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS.get(unit, 1))


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing a rank's output says. ``rank``: the global rank when the line says it
    (``[rankN]:``, ``[Rank N]``), ``local_rank`` from a ``[defaultN]:`` prefix; None when
    the line is not attributed. ``kind``: nccl_timeout, nccl_progress, nccl_aborted,
    nccl_heartbeat, gloo_timeout, peer_closed, cuda_oom, dataloader_killed, shm_bus_error,
    shm_full (torch 2.x preallocates: "unable to allocate shared memory(shm) for file ...: No
    space left on device"), exception, said (a message of the emitter catalog that decides
    alone: its id, kind, layer and confidence ceiling in ``fields``), reports (a catalog
    message that reports a failure elsewhere). ``fields`` holds what the line measured (op,
    seq, timeout_ms, ...)."""

    kind: str
    rank: int | None
    local_rank: int | None
    line: str
    fields: tuple[tuple[str, str], ...] = ()
    # The time the line itself carries (line_stamp), and that time resolved to the
    # caller's clock (ns) once it knows the year and zone: see stamp_to_epoch.
    stamp: Stamp | None = None
    at_ns: int | None = None

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.fields if k == name), None)


# (year or None, month, day, hour, minute, second, microsecond), in the writer's local time
Stamp = tuple[int | None, int, int, int, int, int, int]

# glog (torch's C++ and, since 2.4, its Python logs): "E1202 18:15:56.797176003 ...", also
# "[E1202 ...]"; Python logging and the 2.1-2.3 agent: "2026-12-02 18:24:01,331"
# (c10's own logger leaves the month unpadded: "[E626 05:14:36.393067540 ...]" is June 26)
_GLOG_STAMP = re.compile(r"^\[?[IWEF](\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,20}))? ")
_ISO_STAMP = re.compile(r"^\[?(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[,.](\d{1,20}))?")
# glog's failure signal handler dates the signal in epoch seconds ("*** Aborted at 1663571708
# (unix time) try ..."; PaddlePaddle wraps it in "[TimeInfo: ...]"): when the process died
_SIGNAL_TIME = re.compile(r"^\[?(?:TimeInfo: )?\*\*\* Aborted at (\d{9,11}) \(unix time\)")


def line_stamp(body: str) -> Stamp | None:
    """The time at the start of a (prefix-stripped) line, as written; None when it has none
    (torch 1.x ``[E ProcessGroupNCCL.cpp:737]``, gloo's own lines, tracebacks). glog's signal
    banner's epoch seconds are read as the local time they were."""
    m = _GLOG_STAMP.match(body)
    year = None
    if m is None and (t := _SIGNAL_TIME.match(body)) is not None:
        at = time.localtime(int(t[1]))  # local time, as every stamp here is read
        return (at.tm_year, at.tm_mon, at.tm_mday, at.tm_hour, at.tm_min, at.tm_sec, 0)
    if m is not None:
        parts, frac = [int(m[i]) for i in range(1, 6)], m[6]
    else:
        m = _ISO_STAMP.match(body)
        if m is None:
            return None
        year = int(m[1])
        parts, frac = [int(m[i]) for i in range(2, 7)], m[7]
    micro = int((frac + "000000")[:6]) if frac else 0
    mon, day, hh, mm, ss = parts
    if not (1 <= mon <= 12 and 1 <= day <= 31 and hh < 24 and mm < 60 and ss < 62):
        return None
    return (year, mon, day, hh, mm, ss, micro)


def stamp_to_epoch(
    stamp: Stamp, near: float, max_gap_s: float = 2 * 86400, not_after: float | None = None
) -> float | None:
    """A line's stamp as epoch seconds, read as this machine's local time (the writer's,
    on the same node); a glog stamp has no year: the one that puts it nearest ``near``, and
    none that puts it after ``not_after`` (a log read later). None when it lands more than
    ``max_gap_s`` from ``near`` (another zone, another run)."""
    year, mon, day, hh, mm, ss, micro = stamp
    base = time.localtime(near).tm_year
    best: float | None = None
    for y in (year,) if year is not None else (base - 1, base, base + 1):
        try:
            t = time.mktime((y, mon, day, hh, mm, ss, 0, 0, -1)) + micro / 1e6
        except (OverflowError, ValueError):
            continue
        if year is None and not_after is not None and t > not_after:
            continue
        if best is None or abs(t - near) < abs(best - near):
            best = t
    if best is None or abs(best - near) > max_gap_s:
        return None
    return best


# an optional "[80746] " in front (some launchers add the pid), then the rank prefixes
_PREFIX = re.compile(r"^(?:\[\d+\] )?(?:\[(?:rank(\d{1,20})|([a-z_]+?)(\d{1,20}))\]:)+")
_NCCL_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d{1,20}), OpType=(\w+)"
    r"(?:, NumelIn=(\d{1,20}), NumelOut=(\d{1,20}))?, Timeout\(ms\)=(\d{1,20})\)"
    # the tail is cut where a copy wrapped the line ("ran for" / "600060 milliseconds ...")
    r"(?: ran for (\d{1,20}) milliseconds)?"
)
_NCCL_RANK = re.compile(r"\[(?:PG (?:ID )?\d+ (?:PG GUID \S+ )?)?Rank (\d{1,20})\]")
_NCCL_PROGRESS = re.compile(
    r"[Ll]ast enqueued (?:NCCL )?work: (-?\d{1,20}), last completed (?:NCCL )?work: (-?\d{1,20})"
)
_NCCL_ABORTED = re.compile(r"NCCL communicator was aborted|communicator was aborted on rank")
_HEARTBEAT = re.compile(r"[Hh]eartbeat monitor timed out|watchdog (?:thread )?got stuck")
# gloo's own words; the "[.../gloo/transport/tcp/unbound_buffer.cc:136] " before them is where
# it threw, and a copy may have wrapped it onto the line before
_GLOO_TIMEOUT = re.compile(r"(?:gloo/\S+\] )?Timed out waiting (\d{1,20})ms for (\w+) operation to complete")
# the peer's end of the connection went away (gloo's Pair::read and Pair::write, pair.cc): closed
# ("Connection closed by peer"), or reset or broken under a read or a write (ECONNRESET, EPIPE:
# the peer process died); never a timeout or another errno, which are the network's
_PEER_CLOSED = re.compile(
    r"gloo/\S+\] (?:Connection closed by peer|Read error|writev) \[?([\w.:]+?)\]?:(\d{1,20})"
    r"(?:$|[^:\d]|: (?:Connection reset by peer|Broken pipe))"
)
_CUDA_OOM = re.compile(
    r"CUDA out of memory\. Tried to allocate (\d{1,15}(?:\.\d{1,6})?) (B|KiB|MiB|GiB|TiB)"
    r"(?:[ .(]+GPU (\d{1,20})(?:; | has a total capacity of )(\d{1,15}(?:\.\d{1,6})?) (B|KiB|MiB|GiB|TiB)"
    r"(?: total capacity| of which (\d{1,15}(?:\.\d{1,6})?) (B|KiB|MiB|GiB|TiB) is free)?)?"
)
# the caching allocator's message cut after its head ("...OutOfMemoryError: CUDA out of memory.",
# a paste or a logger that kept the first sentence): the exception's words are the allocator's own
_CUDA_OOM_HEAD = re.compile(r"(?:Error|Exception): CUDA out of memory\.?(?: Tried to allocate)?\s{0,4}$")
_DATALOADER = re.compile(
    r"DataLoader worker \(pids?\(?s?\)? ?([\d, ]+)\) (?:is killed by signal: ([\w ]+)|exited)"
)
# DataLoader's SIGBUS handler (torch/csrc/DataLoader.cpp) writes one fixed message, "ERROR:
# Unexpected bus error encountered in worker. This might be caused by insufficient shared
# memory (shm).": its head names it, so a paste wrapped inside its hint still does
_SHM = re.compile(r"Unexpected bus error encountered in worker\b", re.IGNORECASE)
_SHM_FULL = re.compile(
    r"unable to (?:allocate|write to) shared memory\s?\(shm\)|No space left on device.*?/dev/shm"
)
_EXCEPTION = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Timeout)\w*)(?:: (.*))?$"
)
_C10D_FRAME = re.compile(r"distributed_c10d\.py\", line \d+, in (\w+)")
_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "monitored_barrier",
}


# a launcher that prints each failed rank's captured output between markers (Composer's
# launcher, composer/cli/launcher.py _print_process_exit_status: STDOUT, STDERR, or "logs"
# where both went to one file): the lines between them are that rank's
_BLOCK_BEGIN = re.compile(r"^-{5,20}Begin global rank (\d{1,10}) (?:STDOUT|STDERR|logs)-{5,20}$")
_BLOCK_END = re.compile(r"^-{5,20}End global rank (\d{1,10}) (?:STDOUT|STDERR|logs)-{5,20}$")


def _in_blocks(split: list[tuple[int | None, int | None, str]]) -> list[tuple[int | None, int | None, str]]:
    """Lines without a prefix of their own inside a rank's block, given that rank."""
    out: list[tuple[int | None, int | None, str]] = []
    block: int | None = None
    for rank, local, line in split:
        body = line.strip()
        if rank is None and local is None:
            begin = _BLOCK_BEGIN.match(body)
            if begin:
                block = int(begin[1])
            elif _BLOCK_END.match(body):
                block = None
            elif block is not None:
                rank = block
        out.append((rank, local, line))
    return out


def _split_prefix(line: str) -> tuple[int | None, int | None, str]:
    m = _PREFIX.match(line)
    if not m:
        return None, None, line
    rank = int(m[1]) if m[1] is not None else None
    local = int(m[3]) if m[3] is not None else None
    rest = line[m.end() :]
    return rank, local, rest[1:] if rest.startswith(" ") else rest  # torch writes "[rank0]: "


def parse_rank_output(text: str) -> list[Finding]:
    """Every finding in ``text``, in order, each with the time its line carries (``stamp``).
    Traceback state is kept per prefix, so the interleaved tracebacks of several ranks stay
    apart."""
    return [
        f if f.stamp is not None or (st := line_stamp(f.line)) is None else replace(f, stamp=st)
        for f in _parse(text)
    ]


def _parse(text: str) -> list[Finding]:
    out: list[Finding] = []
    in_traceback: dict[tuple[int | None, int | None], str | None] = {}  # prefix -> collective
    split = _in_blocks([_split_prefix(raw.rstrip()) for raw in text.splitlines()])
    hits = (
        catalog()
        .part("output", deciding=True, reports=True)
        .scan_lines([line.strip() for _, _, line in split])
    )
    dated: dict[tuple[int | None, int | None], tuple[int, Stamp]] = {}  # prefix -> a signal's time
    for i, ((rank, local, line), found) in enumerate(zip(split, hits, strict=True)):
        body = line.strip()
        if body.startswith(("*** Aborted at", "[TimeInfo:")) and (st := line_stamp(body)) is not None:
            dated[(rank, local)] = (i, st)
        # what decides alone, and an output's word that another process of the job died
        # abruptly (a DataLoader's workers: the catalog's relays_death), which explains an
        # exception that only relays it
        said = [h for h in found if h.message.decides or h.message.relays_death]
        if any(_reports(h.message) for h in found):
            # its words report a failure elsewhere (a peer gone, Horovod shut down by another
            # rank's exception), whatever else the line is: peers.py weighs it so
            out.append(Finding("reports", rank, local, body))
        key = (rank, local)
        if body == "Traceback (most recent call last):":
            in_traceback[key] = None
            continue
        if key in in_traceback:
            frame = _C10D_FRAME.search(body)
            if frame and frame[1] in _COLLECTIVES:
                in_traceback[key] = frame[1]
            if line[:1] not in (" ", "\t", "") and not body.startswith("File "):
                m = _EXCEPTION.match(body)
                if m:
                    collective = in_traceback.pop(key)
                    fields = [("type", m[1]), ("message", (m[2] or "").strip())]
                    if collective:
                        fields.append(("collective", collective))
                    if not _reported(body) and m[1].rsplit(".", 1)[-1] not in _REPORTING_EXCEPTIONS:
                        # a launcher's exception about the process it ran (subprocess's
                        # CalledProcessError of `torchrun ...`, spawn's ProcessExitedException)
                        # reports another process's end: the job's, not this process's own
                        out.append(Finding("exception", rank, local, body, tuple(fields)))
                    # the same line may also say what went wrong (a gloo timeout, a CUDA OOM)
                elif not body.startswith(("During handling", "The above exception")):
                    in_traceback.pop(key, None)
        _structured(body, rank, local, out)
        if said and any(h.message.layer == "symptom" for h in said) and _reported(body):
            # a launcher's or framework's report of another process's death (spawn's
            # ProcessExitedException, Ray's ActorDiedError) is not this process's own end
            said = [h for h in said if h.message.layer != "symptom"]
        for hit in said:
            told = said_fields(hit)
            if _WHAT.match(body) and not _RELAYED.search(body) and hit.message.kind == Kind.PYTHON_EXCEPTION:
                # libstdc++'s terminate handler prints "what():" of an exception nothing caught
                # (thrown in a destructor or a thread of its own): it aborted the process, and
                # no Python exception was raised. Not the NCCL watchdog's rethrow of the error
                # its collective's GPU work hit: that error is the rank's own failure
                told = (*((k, "abort" if k == "said_kind" else v) for k, v in told), ("terminated", "1"))
            at = _signal_time(dated, (rank, local), i) if line_stamp(body) is None else None
            out.append(Finding("said", rank, local, body, told, stamp=at))
    return _raised_too(out)


def _signal_time(
    dated: dict[tuple[int | None, int | None], tuple[int, Stamp]], key: tuple[int | None, int | None], i: int
) -> Stamp | None:
    """The time glog's signal handler wrote a few lines above a banner of the same prefix
    (``*** Aborted at N (unix time)`` before ``*** SIGSEGV ... received by PID``): the
    banner's time where its line carries none."""
    at = dated.get(key)
    return at[1] if at is not None and 0 < i - at[0] <= 3 else None


def _raised_too(out: list[Finding]) -> list[Finding]:
    """A terminate's ``what():`` whose error the same process also raised in Python (the NCCL
    watchdog's thread aborts on the CUDA error its main thread raised): the raise stands, the
    abort is its echo in another thread. An unprefixed ``what():`` (libstdc++ writes to the
    file descriptor, past a launcher's rank prefix) goes with a raise of any rank's."""
    raised = {
        (f.rank, f.local_rank, f.get("id")) for f in out if f.kind == "said" and not f.get("terminated")
    }
    raised |= {(None, None, ident) for _, _, ident in raised}
    return [
        Finding(
            f.kind,
            f.rank,
            f.local_rank,
            f.line,
            tuple(
                (k, Kind.PYTHON_EXCEPTION.value if k == "said_kind" else v)
                for k, v in f.fields
                if k != "terminated"
            ),
            f.stamp,
            f.at_ns,
        )
        if f.get("terminated") and (f.rank, f.local_rank, f.get("id")) in raised
        else f
        for f in out
    ]


_WHAT = re.compile(r"^what\(\):\s")
_RELAYED = re.compile(r"watchdog thread terminated with exception")


# exceptions a launcher raises about a process it ran, whatever their message says (Python's
# subprocess, torch elastic's and torch.multiprocessing.spawn's, Ray's): another process's end
_REPORTING_EXCEPTIONS = frozenset(
    {
        "CalledProcessError",
        "ChildFailedError",
        "ProcessRaisedException",
        "ProcessExitedException",
        "ActorDiedError",
    }
)


def _reports(m: Message) -> bool:
    """A message of the rank's own output that tells of another process's failure and names
    no killer of its own (the catalog's reports, not a death it relays: a DataLoader
    worker's is the rank's own failure)."""
    return m.layer == "report" and m.kind is None and not m.relays_death


def _reported(line: str) -> bool:
    """The line is a launcher's, a shell's or a scheduler's message (about a process it ran),
    not the process's own word; a rank's own exception that quotes a peer's failure
    ("Connection closed by peer") is still its own end."""
    return bool(catalog().part("agent", "shell", "scheduler").scan(line))


def _structured(body: str, rank: int | None, local: int | None, out: list[Finding]) -> None:
    """The findings the parsers above read from one line, with their measured fields."""
    m = _NCCL_TIMEOUT.search(body)
    if m:
        r = _NCCL_RANK.search(body)
        fields = [("seq", m[1]), ("op", m[2]), ("timeout_ms", m[5])]
        if m[6] is not None:
            fields.append(("ran_ms", m[6]))
        if m[3] is not None:
            fields += [("numel_in", m[3]), ("numel_out", m[4])]
        out.append(Finding("nccl_timeout", int(r[1]) if r else rank, local, body, tuple(fields)))
        return
    m = _NCCL_PROGRESS.search(body)
    if m:
        r = _NCCL_RANK.search(body)
        out.append(
            Finding(
                "nccl_progress",
                int(r[1]) if r else rank,
                local,
                body,
                (("last_enqueued", m[1]), ("last_completed", m[2])),
            )
        )
        return
    if _NCCL_ABORTED.search(body):
        out.append(Finding("nccl_aborted", rank, local, body))
        return
    if _HEARTBEAT.search(body):
        out.append(Finding("nccl_heartbeat", rank, local, body))
        return
    m = _GLOO_TIMEOUT.search(body)
    if m:
        out.append(Finding("gloo_timeout", rank, local, body, (("timeout_ms", m[1]), ("op", m[2]))))
        return
    m = _PEER_CLOSED.search(body)
    if m:
        out.append(Finding("peer_closed", rank, local, body, (("peer", f"{m[1]}:{m[2]}"),)))
        return
    m = _CUDA_OOM.search(body)
    if m is None and ("CUDA error: out of memory" in body or _CUDA_OOM_HEAD.search(body)):
        out.append(Finding("cuda_oom", rank, local, body))
        return
    if m:
        fields = [("requested_bytes", str(size_to_bytes(m[1], m[2])))]
        if m[3] is not None:
            fields.append(("gpu", m[3]))
        if m[4] is not None:
            fields.append(("total_bytes", str(size_to_bytes(m[4], m[5]))))
        if m[6] is not None:
            fields.append(("free_bytes", str(size_to_bytes(m[6], m[7]))))
        out.append(Finding("cuda_oom", rank, local, body, tuple(fields)))
        return
    m = _DATALOADER.search(body)
    if m:
        fields = [("pids", m[1].strip())]
        if m[2]:
            fields.append(("signal", m[2].strip()))
        out.append(Finding("dataloader_killed", rank, local, body, tuple(fields)))
        return
    if _SHM.search(body):
        out.append(Finding("shm_bus_error", rank, local, body))
    elif _SHM_FULL.search(body):
        out.append(Finding("shm_full", rank, local, body))


def said_fields(hit: Hit) -> tuple[tuple[str, str], ...]:
    """A catalog message found in a line, as a finding's fields: which message, what it
    decides alone, and what its pattern captured."""
    m = hit.message
    return (
        ("id", m.id),
        ("said_kind", m.kind.value if m.kind else ""),
        ("layer", m.layer),
        ("ceiling", m.confidence.value),
        *((("relays_death", "1"),) if m.relays_death else ()),
        *hit.fields,
    )
