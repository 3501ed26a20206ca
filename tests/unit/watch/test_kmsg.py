"""The kernel log's reader on the real /dev/kmsg: a catch-up hands on, from the caller's
thread, every record written before it was called, whether or not the reader's thread ran."""

from __future__ import annotations

import threading
import uuid

import pytest

from sidecar.parse.kernel import KmsgRecord
from sidecar.watch.kmsg import KmsgWatcher
from tests.support.runs import write_kmsg
from tests.support.skips import requires

pytestmark = [pytest.mark.root, requires("kmsg", "kmsg-write")]


def test_a_catch_up_hands_on_what_the_thread_has_not(monkeypatch):
    """The autopsy's round calls catch_up before it judges: the kernel writes its OOM report
    before its SIGKILL, so the record of a kill whose exit is known is there to read even
    where the reader's thread never ran (here it is kept from reading at all)."""
    monkeypatch.setattr(KmsgWatcher, "_run", lambda self: None)
    seen: list[KmsgRecord] = []
    watcher = KmsgWatcher(seen.append)
    watcher.start()
    try:
        mark = f"trainwatch-test-{uuid.uuid4().hex}"
        write_kmsg(f"<6>{mark}")
        assert not any(mark in r.text for r in seen)  # the thread reads nothing
        watcher.catch_up()
        assert [r.text for r in seen if mark in r.text] == [mark]
        watcher.catch_up()  # nothing new: nothing handed on twice
        assert [r.text for r in seen if mark in r.text] == [mark]
    finally:
        watcher.stop()
    watcher.catch_up()  # stopped: a no-op, never an error


def test_the_thread_and_catch_ups_hand_every_record_on_once():
    seen: list[str] = []
    lock = threading.Lock()

    def keep(record: KmsgRecord) -> None:
        with lock:
            seen.append(record.text)

    watcher = KmsgWatcher(keep)
    watcher.start()
    try:
        mark = f"trainwatch-test-{uuid.uuid4().hex}"
        wanted = [f"{mark} {i}" for i in range(200)]
        catching = threading.Event()

        def catch_ups() -> None:
            while not catching.is_set():
                watcher.catch_up()

        helper = threading.Thread(target=catch_ups)
        helper.start()
        try:
            for text in wanted:
                write_kmsg(f"<6>{text}")
        finally:
            catching.set()
            helper.join()
        watcher.catch_up()  # everything written is handed on by now, by one reader or the other
        with lock:
            got = [t for t in seen if t.startswith(mark)]
        assert got == wanted
    finally:
        watcher.stop()
