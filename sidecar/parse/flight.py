"""NCCL flight-recorder dumps: which rank never entered which collective.

With ``TORCH_FR_BUFFER_SIZE`` (older: ``TORCH_NCCL_TRACE_BUFFER_SIZE``) > 0 and
``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, each rank writes its recent collectives to
``<TORCH_FR_DUMP_TEMP_FILE><rank>`` (older: ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default
``/tmp/nccl_trace_rank_``) when a collective times out. The dump is a pickled dict of
plain data (``version``, ``pg_config``, ``pg_status``, ``entries``, ...; a JSON variant
exists). ``pg_status`` has, per process group, the last enqueued, started and completed
collective sequence numbers; the entries have ``collective_seq_id``, ``profiling_name``
(``nccl:all_reduce``), ``state`` and ``timeout_ms``.

The dumps are files written by the job, read by a daemon that may run as root: they are
unpickled with an unpickler that refuses every class, so only plain data can load, and
they are size-capped (``MAX_DUMP_BYTES``) by whoever reads them: this module reads no file.
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_DUMP_BYTES", "FlightDump", "FlightVerdict", "parse_dump", "summarise"]

MAX_DUMP_BYTES = 64 << 20


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a flight-recorder dump holds plain data only")


@dataclass(frozen=True, slots=True)
class FlightDump:
    rank: int
    path: str
    version: str | None
    # process group name -> (last enqueued, last started, last completed) collective seq
    status: dict[str, tuple[int, int, int]]
    # process group name -> {collective seq: (op name, state, timeout ms)}
    entries: dict[str, dict[int, tuple[str, str, int | None]]]


def _mapping(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any, default: int = -1) -> int:
    """A sequence number as the recorder writes it (an int, or its decimal string)."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit() and len(value) < 20:
        return int(value)
    return default


def parse_dump(data: bytes, rank: int, path: str) -> FlightDump:
    """A dump's bytes (read by the caller, at most ``MAX_DUMP_BYTES``); ``path`` names it
    in messages. Raises ValueError (not a dump, or a pickle that names a class)."""
    try:
        doc: Any = json.loads(data) if data[:1] == b"{" else _PlainData(io.BytesIO(data)).load()
    except Exception as exc:  # whatever a hostile pickle makes the loader raise: not a dump
        raise ValueError(f"{path}: not a flight-recorder dump ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or "entries" not in doc:
        raise ValueError(f"{path}: not a flight-recorder dump (no entries)")
    try:
        return _read_dump(doc, rank, path)
    except RecursionError:  # a structure nested too deeply to print: not the recorder's
        raise ValueError(f"{path}: not a flight-recorder dump (nested too deeply)") from None


def _read_dump(doc: dict[Any, Any], rank: int, path: str) -> FlightDump:
    names: dict[str, str] = {}
    for key, cfg in _mapping(doc.get("pg_config")).items():
        if isinstance(cfg, dict):
            names[str(key)] = str(cfg.get("desc") or cfg.get("name") or key)
    status: dict[str, tuple[int, int, int]] = {}
    for key, st in _mapping(doc.get("pg_status")).items():
        if isinstance(st, dict):
            status[names.get(str(key), str(key))] = (
                _int(st.get("last_enqueued_collective")),
                _int(st.get("last_started_collective")),
                _int(st.get("last_completed_collective")),
            )
    entries: dict[str, dict[int, tuple[str, str, int | None]]] = {}
    listed = doc.get("entries")
    for e in listed if isinstance(listed, list) else []:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        pg = e.get("process_group")
        pg_name = (
            str(pg[1])
            if isinstance(pg, (list, tuple)) and len(pg) > 1
            else names.get(str(e.get("pg_id")), "?")
        )
        seq = e.get("collective_seq_id")
        if isinstance(seq, int):
            name = str(e.get("profiling_name") or "?").split(":", 1)[-1]
            timeout = e.get("timeout_ms")
            entries.setdefault(pg_name, {})[seq] = (
                name,
                str(e.get("state") or "?"),
                int(timeout) if isinstance(timeout, int) else None,
            )
    return FlightDump(rank, path, str(doc.get("version")) if "version" in doc else None, status, entries)


@dataclass(frozen=True, slots=True)
class FlightVerdict:
    """For the process group that is stuck: the collective (seq, op) the furthest ranks
    enqueued, the ranks that never enqueued it, and one line per rank."""

    process_group: str
    seq: int
    op: str | None
    laggards: tuple[int, ...]
    lines: tuple[str, ...]
    dumped: tuple[int, ...] = ()  # the ranks whose dump was read


def summarise(dumps: list[FlightDump], world_ranks: tuple[int, ...] = ()) -> FlightVerdict | None:
    """Which rank never entered which collective. ``world_ranks``: the ranks that should
    have dumped; one that did not is counted as missing too (it may have hung or died
    without dumping)."""
    if not dumps:
        return None
    groups: dict[str, dict[int, tuple[int, int, int]]] = {}
    for d in dumps:
        for pg, st in d.status.items():
            groups.setdefault(pg, {})[d.rank] = st
    best: FlightVerdict | None = None
    for pg, by_rank in groups.items():
        stuck = [r for r, (enq, _s, done) in by_rank.items() if enq > done]
        if not stuck:
            continue
        seq = max(by_rank[r][0] for r in stuck)
        op = next(
            (d.entries.get(pg, {}).get(seq, (None,))[0] for d in dumps if seq in d.entries.get(pg, {})), None
        )
        laggards = sorted(r for r, (enq, _s, _d) in by_rank.items() if enq < seq)
        no_dump = sorted(r for r in world_ranks if r not in by_rank)
        lines = []
        for r in sorted(by_rank):
            enq, _started, done = by_rank[r]
            lines.append(
                f"flight recorder, rank {r}, {pg}: last enqueued #{enq}, last completed #{done}"
                + (f" (never entered #{seq})" if enq < seq else f" (waiting in #{seq})" if done < seq else "")
            )
        for r in no_dump:
            lines.append(
                f"flight recorder, rank {r}: wrote no dump (hung, dead, or the recorder was off there)"
            )
        verdict = FlightVerdict(
            pg, seq, op, tuple(sorted({*laggards, *no_dump})), tuple(lines), tuple(sorted(by_rank))
        )
        if best is None or len(verdict.laggards) > len(best.laggards):
            best = verdict
    return best
