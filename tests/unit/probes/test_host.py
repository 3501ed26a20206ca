"""Host memory files, on text captured from this machine and from the kernel docs."""

from __future__ import annotations

import pytest

from sidecar.errors import ParseError
from sidecar.probes.host import HostReader, parse_meminfo, parse_psi, parse_vmstat_oom_kill
from tests.conftest import PROC_TORCHRUN


def test_meminfo_captured():
    m = parse_meminfo((PROC_TORCHRUN / "meminfo").read_bytes())
    assert m.total_bytes == 24683584 * 1024
    assert 0 < m.available_bytes <= m.total_bytes


def test_meminfo_without_available_is_malformed():
    with pytest.raises(ParseError):
        parse_meminfo(b"MemTotal: 100 kB\nMemFree: 50 kB\n")


def test_vmstat_oom_kill_captured_and_absent():
    assert parse_vmstat_oom_kill((PROC_TORCHRUN / "vmstat").read_bytes()) == 0
    assert parse_vmstat_oom_kill(b"nr_free_pages 1\noom_kill 7\nnr_x 2\n") == 7
    assert parse_vmstat_oom_kill(b"oom_kill 3\n") == 3
    assert parse_vmstat_oom_kill(b"nr_free_pages 1\n") is None  # kernels before 4.13


def test_psi_captured_and_documented():
    p = parse_psi((PROC_TORCHRUN / "pressure" / "memory").read_bytes())
    assert p.some_avg10_ratio == 0.0 and p.full_total_seconds == 0.0
    doc = (
        b"some avg10=0.22 avg60=0.17 avg300=1.11 total=58761459\n"
        b"full avg10=0.23 avg60=0.16 avg300=1.08 total=58464525\n"
    )
    p = parse_psi(doc)
    assert p.some_avg10_ratio == pytest.approx(0.0022) and p.some_total_seconds == pytest.approx(58.761459)
    assert p.full_avg10_ratio == pytest.approx(0.0023)
    with pytest.raises(ParseError):
        parse_psi(b"full avg10=0.00 total=0\n")


def test_host_reader_on_fixture_and_real(tmp_path):
    s = HostReader(str(PROC_TORCHRUN), str(tmp_path)).sample()
    assert s.total_bytes == 24683584 * 1024 and s.oom_kills == 0 and s.psi_some_avg10_ratio == 0.0
    assert s.shm_total_bytes and s.shm_total_bytes > 0
    real = HostReader().sample()
    assert real.total_bytes > real.available_bytes > 0


def test_host_reader_degrades_without_optional_files(tmp_path):
    (tmp_path / "meminfo").write_bytes((PROC_TORCHRUN / "meminfo").read_bytes())
    s = HostReader(str(tmp_path), str(tmp_path / "no-shm")).sample()
    assert s.oom_kills is None and s.psi_some_avg10_ratio is None and s.shm_used_bytes is None
