"""Flight-recorder dumps: the real one-rank dump the H200 wrote on an NCCL timeout, dumps
of a four-rank job where rank 1 never entered the collective, hostile files, and the
postmortem the H200's dump gives."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from sidecar.autopsy import Evidence, RankState, autopsy
from sidecar.parse.flight import FlightDump, parse_dump, summarise
from sidecar.parse.ranks import Finding, parse_rank_output
from tests.support.paths import DEVICE_H200
from tests.support.paths import FR_DUMP as DUMP

S = 10**9


def test_the_real_dump_of_a_one_rank_nccl_timeout():
    d = _load(DUMP, 0)
    assert d.version == "2.10"
    assert d.status == {"default_pg": (2, -1, 1)}
    assert d.entries["default_pg"] == {
        1: ("all_reduce", "completed", 5000),
        2: ("all_reduce", "scheduled", 5000),
    }
    v = summarise([d], (0,))
    assert v is not None and (v.process_group, v.seq, v.op, v.laggards) == ("default_pg", 2, "all_reduce", ())
    assert v.lines == (
        "flight recorder, rank 0, default_pg: last enqueued #2, last completed #1 (waiting in #2)",
    )


def _load(path: Path | str, rank: int) -> FlightDump:
    return parse_dump(Path(path).read_bytes(), rank, str(path))


def _dump(tmp: Path, rank: int, enqueued: int, completed: int) -> str:
    entries = [
        {
            "collective_seq_id": seq,
            "profiling_name": "nccl:all_reduce",
            "state": "completed" if seq <= completed else "scheduled",
            "timeout_ms": 600000,
            "process_group": ("0", "default_pg"),
            "is_p2p": False,
        }
        for seq in range(max(1, enqueued - 2), enqueued + 1)
    ]
    doc = {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": enqueued,
                "last_started_collective": enqueued,
                "last_completed_collective": completed,
            }
        },
        "entries": entries,
    }
    path = tmp / f"nccl_trace_rank_{rank}"
    path.write_bytes(pickle.dumps(doc))
    return str(path)


def test_the_rank_that_never_entered_is_named_by_sequence_numbers(tmp_path):
    dumps = [_load(_dump(tmp_path, r, 1580 if r != 1 else 1579, 1579), r) for r in (0, 1, 2, 3)]
    v = summarise(dumps, (0, 1, 2, 3))
    assert v is not None and (v.seq, v.op, v.laggards) == (1580, "all_reduce", (1,))
    assert "rank 1, default_pg: last enqueued #1579, last completed #1579 (never entered #1580)" in v.lines[1]
    # a rank that wrote no dump is a suspect too
    v = summarise([dumps[0], dumps[2], dumps[3]], (0, 1, 2, 3))
    assert v is not None and v.laggards == (1,) and any("rank 1: wrote no dump" in line for line in v.lines)
    # the verdict names it, and says how it knows
    ranks = tuple(
        RankState(str(r), r, r, 100 + r, (), 6, (10 + r) * S, None, None, "connector") for r in range(4)
    )
    timeout = Finding(
        "nccl_timeout",
        0,
        None,
        "Watchdog caught ...",
        (("seq", "1580"), ("op", "ALLREDUCE"), ("timeout_ms", "600000")),
    )
    out = tuple((str(r), Finding("nccl_timeout", r, None, "x", timeout.fields)) for r in (0, 2, 3))
    verdict = autopsy(Evidence(ranks, output=out, flight=summarise(dumps, (0, 1, 2, 3)), flight_enabled=True))
    assert verdict is not None and verdict.kind == "collective_timeout"
    assert (
        "NCCL all_reduce (SeqNum 1580) did not complete within 600 s; "
        "rank 1 never entered it (flight recorder)" in verdict.summary
    )
    assert sum(e.source == "flight_recorder" for e in verdict.evidence) == 4


def test_a_hostile_dump_is_refused_not_run(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps({"entries": [Boom()]}))
    with pytest.raises(ValueError, match=r"refused (posix|os)\.system"):
        _load(path, 0)
    assert not (tmp_path / "pwned").exists()
    path.write_bytes(b"\x80\x05garbage")
    with pytest.raises(ValueError, match="not a flight-recorder dump"):
        _load(path, 0)
    path.write_text('{"version": "2.10", "entries": [], "pg_status": {}}')  # the JSON variant
    assert _load(path, 0).status == {}


def _rank(label: str, pid: int, code: int | None, died: int | None) -> RankState:
    return RankState(label, int(label), int(label), pid, (), code, died, "/job", None, "connector")


def test_the_real_flight_recorder_dump_of_the_h200():
    """The dump torch 2.11 wrote on the H200 when its all_reduce #2 timed out (a world of
    one, the collective queued behind a long kernel), and the postmortem made of it."""
    from dataclasses import replace

    from sidecar.parse.flight import parse_dump, summarise

    path = DEVICE_H200 / "nccl_trace_rank_0"
    dump = parse_dump(path.read_bytes(), 0, str(path))
    assert dump.status == {"default_pg": (2, -1, 1)}
    assert dump.entries["default_pg"][2][:2] == ("all_reduce", "scheduled")
    fr = summarise([dump], (0,))
    assert fr is not None and (fr.seq, fr.op, fr.laggards) == (2, "all_reduce", ())
    # that rank alone of a world of two: the other wrote no dump, so it is the one missing
    two = summarise([dump], (0, 1))
    assert two is not None and two.laggards == (1,)
    doc = json.loads((DEVICE_H200 / "nccl-timeout.postmortem.json").read_text())
    assert doc["killer"]["kind"] == "collective_timeout" and "whole world" in doc["killer"]["summary"]
    cited = {e["source"] for e in doc["killer"]["evidence"]}
    assert {"exit", "output", "flight_recorder"} <= cited
    assert all(e["at"] for e in doc["killer"]["evidence"] if e["source"] == "output")  # each line's own time
    # the verdict again from the fixture, with the dump
    nccl = [("0", f) for f in parse_rank_output((DEVICE_H200 / "nccl-timeout.stderr").read_text())]
    ranks = (_rank("0", 510, 6, S),)
    v = autopsy(Evidence(ranks, output=tuple(nccl), world_size=1, flight=fr, flight_enabled=True))
    assert v is not None and "it is the whole world" in v.summary, v.summary
    assert any(e.source == "flight_recorder" and "waiting in #2" in e.detail for e in v.evidence)
    # two ranks whose dumps both say "waiting in #2": every rank entered it
    both = summarise([dump, replace(dump, rank=1)], (0, 1))
    ranks = (*ranks, _rank("1", 511, 6, S + 1))
    v = autopsy(Evidence(ranks, output=tuple(nccl), world_size=2, flight=both, flight_enabled=True))
    assert v is not None and "every rank entered it (flight recorder)" in v.summary, v.summary
