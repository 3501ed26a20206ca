"""The process connector: exit datagrams captured on 6.18, wait statuses, and a real SIGKILL seen as root."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from sidecar.model.events import ExitEvent
from sidecar.watch.exits import ProcConnector, decode_wait_status, parse_messages, subscribe_message
from tests.support.skips import requires

EXIT_DATAGRAM = bytes.fromhex(
    "4c000000030000000600000000000000"
    "0100000001000000060000000000000028000000"
    "0000008000000000e8105f325c000000"
    "d1180000d11800000900000011000000"
    "0100000001000000"
)


def test_exit_datagram_captured_on_6_18():
    exits, acks = parse_messages(EXIT_DATAGRAM)
    assert exits == [ExitEvent(pid=6353, exit_code=9, parent_pid=1, monotonic_ns=0x5C325F10E8)]
    assert exits[0].signal == 9 and exits[0].returncode == -9 and acks == []


def test_non_leader_threads_are_not_process_exits():
    thread = bytearray(EXIT_DATAGRAM)
    thread[52:56] = (6354).to_bytes(4, "little")  # tid != tgid
    assert parse_messages(bytes(thread)) == ([], [])


@pytest.mark.parametrize(
    "code, expected",
    [
        (9, (None, 9)),
        (15, (None, 15)),
        (768, (3, None)),
        (36608, (143, None)),
        (6, (None, 6)),
        (134, (None, 6)),
        (0, (0, None)),
    ],
)
def test_wait_status_decoding(code, expected):
    assert decode_wait_status(code) == expected


def test_subscription_message_layout():
    msg = subscribe_message(1, None)
    assert len(msg) == 16 + 20 + 4 and int.from_bytes(msg[:4], "little") == len(msg)
    assert msg[16:24] == (1).to_bytes(4, "little") * 2  # CN_IDX_PROC, CN_VAL_PROC
    filtered = subscribe_message(1, 0x20000000)
    assert filtered[-4:] == (0x20000000).to_bytes(4, "little")  # PROC_EVENT_NONZERO_EXIT


@requires("connector")  # root in the host namespaces of a kernel that has it (not gVisor)
def test_real_connector_sees_a_sigkill():
    got: list[ExitEvent] = []
    connector = ProcConnector(got.append)
    connector.start()
    try:
        child = subprocess.Popen(["sleep", "30"])
        child.kill()
        child.wait()
        ok = subprocess.Popen(["sh", "-c", "exit 3"])
        ok.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not {child.pid, ok.pid} <= {e.pid for e in got}:
            time.sleep(0.02)
    finally:
        connector.stop()
    by_pid = {e.pid: e for e in got}
    assert by_pid[child.pid].signal == signal.SIGKILL
    assert by_pid[ok.pid].status == 3 and by_pid[child.pid].parent_pid == os.getpid()
