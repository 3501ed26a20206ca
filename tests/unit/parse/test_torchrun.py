"""The torchrun agent's lines and error files, on the device captures and the public logs: every
generation's failure lines and tables, exit codes as wait statuses, every writer's error file."""

from __future__ import annotations

import json
import re
import signal

import pytest

from sidecar.model import wait_status_from_returncode
from sidecar.model.events import ExitEvent
from sidecar.parse.torchrun import (
    ClosingSignal,
    DeathSignal,
    Escalation,
    FailureEntry,
    WorkerFailed,
    exit_codes_by_pid,
    parse_agent_text,
)
from tests.support.paths import CAPTURES
from tests.support.paths import PUBLIC_CASES as PUBLIC


def test_agent_output_of_torch_2_11_gives_every_ranks_exit_code():
    """Capture A (H200, torch 2.11): rank 2 SIGKILLed itself; rank 0 ignored SIGTERM and was
    SIGKILLed 30 s later; rank 1 died of SIGTERM; rank 3 exited 143 from a handler."""
    capture = json.loads((CAPTURES / "torchrun-A.json").read_text())
    text = "\n".join(re.sub(r"^\d+\.\d+ ", "", line) for line in capture["agent_output"])
    records = parse_agent_text(text)
    assert [r.pid for r in records if isinstance(r, ClosingSignal)] == [576, 577, 579]
    assert all(r.signal == signal.SIGTERM for r in records if isinstance(r, ClosingSignal))
    assert [(r.pid, r.from_signal, r.to_signal) for r in records if isinstance(r, Escalation)] == [
        (576, 15, 9)
    ]
    failed = [r for r in records if isinstance(r, WorkerFailed)]
    assert [(r.exitcode, r.local_rank, r.pid) for r in failed] == [(-9, 2, 578)]
    entries = {r.pid: r for r in records if isinstance(r, FailureEntry)}
    assert {pid: (e.rank, e.exitcode) for pid, e in entries.items()} == {
        576: (0, -9),
        577: (1, -15),
        579: (3, 143),
        578: (2, -9),
    }
    assert [pid for pid, e in entries.items() if e.root_cause] == [578]
    assert entries[576].traceback == "Signal 9 (SIGKILL) received by PID 576"
    assert entries[576].error_file == "<N/A>" and entries[578].time == "2026-12-02_11:52:51"
    codes = exit_codes_by_pid(records)
    assert {pid: rc for pid, (rc, _) in codes.items()} == {578: -9, 576: -9, 577: -15, 579: 143}
    assert "failed (exitcode: -9) local_rank: 2 (pid: 578)" in codes[578][1]


def test_agent_lines_of_older_torch_and_glued_tables():
    cases = {c["id"]: c for c in map(json.loads, PUBLIC.read_text().splitlines())}

    def agent_text(case_id: str) -> str:
        return "\n".join(e["text"] for e in cases[case_id]["evidence"] if e["kind"] == "torchrun_log")

    old = parse_agent_text(agent_text("colossalai-3514-rank0-agent-sigterm"))  # 1.x logger prefix
    assert [r.pid for r in old if isinstance(r, ClosingSignal)] == [812914, 812915, 812916]
    assert [(r.exitcode, r.local_rank, r.pid) for r in old if isinstance(r, WorkerFailed)] == [
        (-9, 3, 812917)
    ]
    glued = parse_agent_text(agent_text("amvur-2-rank2-sigkill-growing-ram"))  # lines run together
    entry = next(r for r in glued if isinstance(r, FailureEntry))
    assert (entry.rank, entry.local_rank, entry.exitcode, entry.pid, entry.root_cause) == (
        2,
        2,
        -9,
        36071,
        True,
    )
    hup = parse_agent_text(agent_text("msswift-5884-sighup-torch25"))  # 2.5 glog style
    assert [r.signal for r in hup if isinstance(r, ClosingSignal)] == [signal.SIGHUP, signal.SIGHUP]
    assert any(isinstance(r, DeathSignal) for r in hup)


def test_torchrun_exitcodes_become_wait_statuses():
    for rc, status in ((-9, 9), (-15, 15), (-6, 6), (143, 143 << 8), (1, 256), (0, 0)):
        assert wait_status_from_returncode(rc) == status
        assert ExitEvent(1, status, 0, 0).returncode == rc


def test_torchelastic_error_files_of_every_writer():
    from sidecar.parse.torchrun import parse_error_file

    rec = parse_error_file(
        '{"message": {"message": "ValueError: bad batch", "extraInfo": {"py_callstack": '
        '"Traceback (most recent call last):\\n  File \\"t.py\\", line 3, in main\\n'
        'ValueError: bad batch\\n", '
        '"timestamp": "1796235841"}}}'
    )
    assert (rec.message, rec.timestamp) == ("ValueError: bad batch", 1796235841)
    assert rec.traceback is not None and rec.traceback.endswith("ValueError: bad batch\n")
    # older writers and the C++ signal handler: a plain string
    assert parse_error_file('{"message": "Signal 11 (SIGSEGV) received"}').message.startswith("Signal 11")
    for bad, why in (("{not json", "not JSON"), ("[]", "no 'message'"), ('{"message": 3}', "neither")):
        with pytest.raises(ValueError, match=why):
            parse_error_file(bad)
