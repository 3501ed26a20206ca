"""The kernel's own records of a process's end that the catalog names (a segfault record),
on the live path: parsed from /dev/kmsg records, kept, and deciding the autopsy for the pid
they name, only when their kind can have ended the rank the way it ended."""

from __future__ import annotations

import signal

from sidecar.autopsy import Evidence, RankState, autopsy
from sidecar.deaths.records import Records
from sidecar.model import Confidence, Kind
from sidecar.parse.kernel import KmsgRecord

S = 10**9
# Linux 6.1+ adds "likely on CPU"; 6.18 prints the offset before the mapping
SEGV = (
    "python[{pid}]: segfault at 0 ip 00007f3336d85ad8 sp 00007ffd87bf53a8 error 4 in "
    "libc.so.6[167ad8,7f3336c44000+156000] likely on CPU 0 (core 0, socket 0)"
)


def _rank(pid: int, sig: int) -> RankState:
    return RankState("1", 1, 1, pid, (), sig, 5 * S, "/job", None, "connector")


def _evidence(rank: RankState, records: Records) -> Evidence:
    return Evidence((rank,), kernel_log_readable=True, kernel_said=tuple(records.said))


def test_a_segfault_record_is_kept_and_names_its_pid():
    records = Records()
    parsed = Records.parse(KmsgRecord(4, 1, 5_000_000, False, SEGV.format(pid=4242)))
    assert parsed is not None and parsed.said == (4242, "linux.segfault")
    assert records.add(parsed) == 4242  # the incident with that death is judged again
    v = autopsy(_evidence(_rank(4242, signal.SIGSEGV), records))
    assert v is not None and (v.kind, v.confidence) == (Kind.SEGFAULT, Confidence.CERTAIN), v
    assert "the kernel's own record names the pid" in v.summary
    assert any("[4242]: segfault at" in e.detail for e in v.evidence)


def test_a_record_of_another_pid_or_another_end_decides_nothing():
    records = Records()
    parsed = Records.parse(KmsgRecord(4, 1, 5_000_000, False, SEGV.format(pid=999)))
    assert parsed is not None
    records.add(parsed)
    other = autopsy(_evidence(_rank(4242, signal.SIGSEGV), records))
    assert other is not None and "kernel's own record" not in other.summary
    assert other.confidence != Confidence.CERTAIN  # no tracepoint, no record: likely at most
    # the record names this pid, but the rank was SIGKILLed: a segfault cannot end it so
    records = Records()
    records.add(Records.parse(KmsgRecord(4, 1, 5_000_000, False, SEGV.format(pid=4242))))  # type: ignore[arg-type]
    killed = autopsy(_evidence(_rank(4242, signal.SIGKILL), records))
    assert killed is not None and killed.kind != Kind.SEGFAULT


def test_another_s_record_is_never_surer_than_the_catalog_says():
    """A kernel record that is not first-hand for the pid (an Xid 61: the driver's word, not
    the process's) is at most likely, and never surer than its catalog entry (possible)."""
    from sidecar.autopsy.ranking import fits
    from sidecar.autopsy.witnesses import kernel_record
    from sidecar.catalog import catalog

    xid = catalog().by_id["nvrm.xid_61"]
    assert not xid.first_hand and xid.confidence == Confidence.POSSIBLE
    text = "NVRM: Xid (PCI:0000:3b:00): 61, pid=4242, 0cec(3098) 00000000 00000000"
    rank = _rank(4242, signal.SIGABRT)
    assert fits(xid.kind, rank.signal, rank.status)  # a GPU error can end a rank so
    said = ((5 * S, 4242, xid.id, text),)
    found = kernel_record(rank, Evidence((rank,), kernel_log_readable=True, kernel_said=said))
    assert found is not None
    kind, confidence, _summary, _item = found
    assert (kind, confidence) == (Kind.GPU_ERROR, Confidence.POSSIBLE)
