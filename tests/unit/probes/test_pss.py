"""PSS and USS of a rank's tree: the smaps_rollup parser on a real capture, and when the
sampler measures (every 30 s, sooner on growth, never over its CPU budget). The real tree
(a rank and its forked workers sharing its pages) is in tests/e2e/test_cgroup.py."""

from __future__ import annotations

import pytest

from sidecar.errors import NoSuchProcess, ParseError
from sidecar.model import ProcKey
from sidecar.probes.proc import parse_smaps_rollup
from sidecar.probes.pss import PssSampler
from tests.support.paths import FIXTURES

KIB = 1024


def test_a_real_rollup():
    data = (FIXTURES / "smaps" / "python-32mib.smaps_rollup").read_bytes()
    pss, uss = parse_smaps_rollup(data)
    assert pss == 45258 * KIB
    assert uss == (5040 + 39648) * KIB  # Private_Clean + Private_Dirty (+ Private_Hugetlb, 0)


@pytest.mark.parametrize("data", [b"", b"Rss: 5 kB\n", b"Pss: x kB\n", b"Pss: " + b"9" * 30 + b" kB\n"])
def test_a_rollup_without_a_usable_pss_is_refused(data):
    with pytest.raises(ParseError):
        parse_smaps_rollup(data)


class Fake:
    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0
        self.cost = 0.001  # CPU seconds one tree's measurement takes
        self.reads: list[int] = []

    def rollup(self, pid: int) -> tuple[int, int]:
        self.reads.append(pid)
        self.cpu += self.cost / 2
        if pid == 99:
            raise NoSuchProcess("gone", str(pid))
        return 10 * pid, pid


def test_measured_at_once_then_every_thirty_seconds_sooner_on_growth():
    f = Fake()
    s = PssSampler(f.rollup, clock=lambda: f.now, cpu=lambda: f.cpu)
    rank = ProcKey(1, 1)
    assert s.of(rank, [1, 2, 99], 1000)[:2] == (30, 3)  # the gone worker is left out
    f.now += 0.5
    assert s.of(rank, [1, 2, 3], 2000)[:2] == (30, 3)  # grew, but within a second of the last
    f.now += 4.5
    assert s.of(rank, [1, 2], 1050)[:2] == (30, 3) and len(f.reads) == 3  # not due, no growth
    f.now += 1
    assert s.of(rank, [1, 2, 3], 2000)[:2] == (60, 6)  # grew by over 10 %: measured
    f.now += 5
    assert s.of(rank, [1, 2, 3], 2000)[:2] == (60, 6) and len(f.reads) == 6  # not due, no new growth
    f.now += 25
    assert s.of(rank, [1, 2, 3], 2000)[:2] == (60, 6) and len(f.reads) == 9  # thirty seconds: due again
    s.forget(set())
    assert s.of(rank, [1], 2000)[:2] == (None, None)  # forgotten, and the budget holds it back
    f.now += 1
    assert s.of(rank, [1], 2000)[:2] == (10, 1)  # measured afresh
    reads = len(f.reads)
    f.now += 40
    assert s.last(rank)[:2] == (10, 1) and len(f.reads) == reads  # between detailed rounds: never measures
    assert s.last(ProcKey(2, 1)) == (None, None, ())


def test_each_worker_s_uss_is_kept_with_its_first_measurement():
    """The rank itself is not a worker; a worker's growth is against its first measurement,
    and a worker that appears later starts from its own."""
    uss = {1: 100, 2: 10, 3: 20}
    s = PssSampler(lambda pid: (uss[pid] * 2, uss[pid]), clock=lambda: now, cpu=lambda: 0.0)
    rank = ProcKey(1, 1)
    now = 0.0
    assert s.of(rank, [1, 2], 1000)[2] == ((2, 10, 10),)
    uss[1], uss[2] = 500, 70  # copy-on-access: worker 2 un-shares 60
    now = 30.0
    assert s.of(rank, [1, 2, 3], 1000)[2] == ((2, 70, 10), (3, 20, 20))


def test_the_limit_growing_is_growth_when_rss_does_not_move():
    """Copy-on-access moves no RSS (the pages were mapped before the fork) but is charged to
    the limit the rank lives under as it happens: that growth makes the tree due too."""
    uss = {1: 100, 2: 10}
    s = PssSampler(lambda pid: (uss[pid] * 2, uss[pid]), clock=lambda: now, cpu=lambda: 0.0)
    rank = ProcKey(1, 1)
    now = 0.0
    s.of(rank, [1, 2], 1000, limit_used=1000)
    uss[2] = 80
    now = 5.0
    assert s.of(rank, [1, 2], 1000, limit_used=1050)[2] == ((2, 10, 10),)  # 5 %: not yet
    now = 6.0
    assert s.of(rank, [1, 2], 1000, limit_used=1200)[2] == ((2, 80, 10),)  # 20 %: measured
    now = 8.0
    assert s.of(rank, [1, 2], 1000, limit_used=1250)[2] == ((2, 80, 10),)  # against the new baseline


def test_a_costly_tree_is_measured_less_often():
    """A measurement that took 0.5 s of CPU holds the next back 50 s (1 % of a core), growth or not."""
    f = Fake()
    f.cost = 0.5
    s = PssSampler(f.rollup, clock=lambda: f.now, cpu=lambda: f.cpu)
    rank = ProcKey(1, 1)
    s.of(rank, [1, 2], 1000)
    f.now += 20
    s.of(rank, [1, 2], 5000)
    assert len(f.reads) == 2  # grown, but the budget holds it back
    f.now += 31
    s.of(rank, [1, 2], 5000)
    assert len(f.reads) == 4
    assert s.measured_total == 2 and s.cpu_seconds == pytest.approx(1.0)


def test_the_budget_is_shared_by_every_tree():
    """Eight trees whose measurement costs 60 ms each: 1 % of a core lets one through every
    6 s, so each is measured every 48 s instead of 30, and the total stays at 1 %."""
    f = Fake()
    f.cost = 0.06
    s = PssSampler(f.rollup, clock=lambda: f.now, cpu=lambda: f.cpu)
    ranks = [ProcKey(i, 1) for i in range(8)]
    start_cpu, start = f.cpu, f.now
    for _ in range(1000):  # rounds of the sampler, every 0.1 s
        for rank in ranks:
            s.of(rank, [1, 2], 1000)
        f.now += 0.1
    assert (f.cpu - start_cpu) / (f.now - start) == pytest.approx(0.01, rel=0.05)
    assert s.measured_total == pytest.approx(100 / 6, abs=2)


def test_trees_take_turns_when_the_budget_is_short():
    """Three trees first in each round could hold the whole budget; the one that has waited
    longest goes first, so the last tree of the round is measured too."""
    f = Fake()
    f.cost = 0.21  # 21 s of budget a measurement: three trees fill more than the 30 s period
    s = PssSampler(f.rollup, clock=lambda: f.now, cpu=lambda: f.cpu)
    ranks = [ProcKey(i, 1) for i in range(8)]
    for _ in range(2400):
        for rank in ranks:
            s.of(rank, [1, 2], 1000)
        f.now += 0.1
    assert all(s.of(rank, [1, 2], 1000)[0] is not None for rank in ranks)


def test_a_tree_nothing_of_which_could_be_read_is_unknown_not_empty():
    """Where smaps_rollup does not exist (kernels before 4.14, gVisor) or every read is
    refused, the tree's PSS and USS are unknown (None), not 0 bytes."""
    from sidecar.errors import ProbeError

    def refused(pid: int) -> tuple[int, int]:
        raise ProbeError(f"/proc/{pid}/smaps_rollup: no such file")

    s = PssSampler(refused, clock=lambda: 100.0, cpu=lambda: 0.0)
    rank = ProcKey(1, 1)
    assert s.of(rank, [1, 2, 3], 1000) == (None, None, ())
    assert s.last(rank) == (None, None, ())
