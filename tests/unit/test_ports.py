"""The tests' ports (tests/support/ports.py): outside the kernel's ephemeral range, whatever
it is on the machine, each pytest worker in its own share."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.support import ports


def test_the_shares_of_two_workers_are_apart_and_outside_the_ephemeral_range() -> None:
    a, b = ports.pool((32768, 60999), 0, 2), ports.pool((32768, 60999), 1, 2)
    assert len(a) > 1000 and len(b) > 1000 and not set(a) & set(b)
    assert all(ports.LOWEST <= p < 32768 for p in (*a, *b))


def test_a_low_ephemeral_range_leaves_the_ports_above_it() -> None:
    share = ports.pool((1024, 40000), 0, 1)
    assert share.start == 40001 and share.stop == 65536


def test_an_ephemeral_range_over_every_port_leaves_the_choice_to_the_kernel() -> None:
    assert not ports.pool((1024, 65535), 0, 4)


def test_the_range_is_read_from_the_machine(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("20000\t50000\n")
    assert ports.ephemeral_range(str(tmp_path / "range")) == (20000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "none")) == (32768, 60999)


def test_a_port_is_free_and_not_one_the_kernel_hands_out() -> None:
    lo, hi = ports.ephemeral_range()
    port = ports.free_port()
    if ports.pool((lo, hi), 0, 1):
        assert not lo <= port <= hi
    with socket.socket() as s:
        s.bind(("", port))
    assert ports.free_port() != port  # taken in turn, not the same one again
