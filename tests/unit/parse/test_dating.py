"""Year-less stamps in pasted logs (glog's ``E1209 06:53:46``, syslog's ``Dec  9 06:53:46``)
get their year from the paste's own dated lines, else the file's time, and never land in
the future."""

from __future__ import annotations

import time

from sidecar.diagnose import LogInput, diagnose
from sidecar.parse.logs import Dating, dating_of, kernel_lines, line_time
from tests.support.agent_text import Failure, failure_table


def _epoch(y: int, mon: int, d: int, hh: int = 0, mm: int = 0, ss: int = 0) -> float:
    return time.mktime((y, mon, d, hh, mm, ss, 0, 0, -1))


NOW = _epoch(2026, 12, 6, 8, 0, 0)

# torch 2.4+'s agent: glog stamps without a year, a failure table with one (2024)
_API = "torch/distributed/elastic/multiprocessing/api.py"
AGENT = (
    f"W1209 06:53:34.100000 812 {_API}:897] Sending process 813 closing signal SIGTERM\n"
    f"E1209 06:53:46.200000 812 {_API}:869] failed (exitcode: -9) local_rank: 1 (pid: 814) of binary: "
    "/bin/python3\n"
    + failure_table(Failure(1, 1, -9, 814, "2024-12-09_06:53:34", "Signal 9 (SIGKILL) received by PID 814"))
)


def test_the_paste_s_own_dated_lines_give_the_year():
    d = dating_of([AGENT], now=NOW)
    assert time.localtime(d.anchor).tm_year == 2024
    doc = diagnose([LogInput("torchrun.log", AGENT)], now=NOW)
    dated = [e["at"] for e in doc["killer"]["evidence"] if e.get("at")]
    assert dated and all(at.startswith("2024-12-09") for at in dated), doc["killer"]["evidence"]
    assert doc["victim"]["died_at"].startswith("2024-12-09"), doc["victim"]


def test_a_kernel_log_s_syslog_stamps_take_the_year_of_another_input():
    kernel = "Dec  9 06:53:46 node-3 kernel: Out of memory: Killed process 814 (python3) total-vm:1kB\n"
    d = dating_of([AGENT, kernel], now=NOW)
    (line,) = kernel_lines(kernel, d)
    assert time.localtime(line.at).tm_year == 2024


def test_without_dated_lines_the_file_s_time_gives_the_year():
    line = "Dec  9 06:53:46 node-3 kernel: Out of memory: Killed process 814 (python3)"
    d = dating_of([line], [_epoch(2025, 12, 10)], now=NOW)
    assert time.localtime(line_time(line, d)).tm_year == 2025
    doc_time = _epoch(2025, 1, 2)  # a log of early January, its file written then: not December 2026
    d = dating_of(["Dec 31 23:59:00 n kernel: x"], [doc_time], now=NOW)
    assert time.localtime(line_time("Dec 31 23:59:00 n kernel: x", d)).tm_year == 2024


def test_a_year_less_stamp_never_lands_in_the_future():
    """Nothing dated, read from standard input on 6 December 2026: 9 December is last year's."""
    d = dating_of(["E1209 06:53:46.2 812 x.py:1] failed (exitcode: -9) local_rank: 0 (pid: 9)"], now=NOW)
    assert d == Dating(NOW, NOW)
    assert time.localtime(d.year_less(12, 9, 6, 53, 46)).tm_year == 2025
    assert time.localtime(d.year_less(12, 5, 6, 53, 46)).tm_year == 2026  # yesterday: this year
    doc = diagnose(
        [LogInput("-", "E1209 06:53:46.200000 812 torch/distributed/elastic/multiprocessing/api.py:869] "
                       "failed (exitcode: -9) local_rank: 0 (pid: 9) of binary: /usr/bin/python3\n")],
        now=NOW,
    )  # fmt: skip
    assert doc["victim"]["died_at"].startswith("2025-12-09"), doc["victim"]


def test_a_dated_line_after_now_is_no_anchor():
    d = dating_of(["[2031-01-01 00:00:00,000] clock skew", "[2026-11-30 10:00:00,000] ok"], now=NOW)
    assert time.localtime(d.anchor)[:3] == (2026, 11, 30)
