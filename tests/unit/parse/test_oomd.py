"""Userspace OOM daemons' lines (a real earlyoom's output, systemd-oomd, oomd, nohang)."""

from __future__ import annotations

import signal

from sidecar.parse.oomd import parse_userspace_oom_line
from tests.support.oomd_lines import EARLYOOM_17, EARLYOOM_18, OOMD, SYSTEMD_OOMD


def test_userspace_oom_lines():
    a = parse_userspace_oom_line(EARLYOOM_17)
    assert a is not None and (a.daemon, a.pid, a.signal, a.comm, a.rss_bytes) == (
        "earlyoom",
        1137,
        signal.SIGTERM,
        "bash",
        4 << 20,
    )
    b = parse_userspace_oom_line(EARLYOOM_18)
    assert b is not None and (b.pid, b.signal, b.rss_bytes) == (4242, signal.SIGKILL, 20480 << 20)
    c = parse_userspace_oom_line(SYSTEMD_OOMD)
    assert c is not None and c.daemon == "systemd-oomd" and c.pid is None
    assert c.cgroup == "/user.slice/user-1000.slice/user@1000.service/app.slice/train.scope"
    d = parse_userspace_oom_line(OOMD)
    assert d is not None and (d.daemon, d.cgroup) == ("oomd", "/workload.slice/train.service")
    for other in ("low memory! at or below SIGTERM limits: mem 10.00%", "oomd: running", ""):
        assert parse_userspace_oom_line(other) is None
