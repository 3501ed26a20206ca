"""One real segfault, each view of it: rank 1 of a real torchrun job (gloo, CPU) under
`trainwatch run` dereferences NULL (its faulthandler on, as rank.py runs). The job runs
once, for the module; each test reads one view of that death: the exit status, the live
postmortem (the signal, the tracepoint's word that the rank raised it itself, the peer's
fate), and `trainwatch diagnose` of the job's output naming the same killer for the same
rank. A segfault with no handler, told by the kernel's own record, is another death
(tests/e2e/test_words.py)."""

from __future__ import annotations

import pytest

from tests.support.e2e import survivor_fate_right
from tests.support.runs import Run, diagnose_job_output, named_alike, only_postmortem, run_once
from tests.support.skips import left_out, met


@pytest.fixture(scope="module")
def segfault(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_once(tmp_path_factory.mktemp("segfault"), "--segfault-rank=1", "--raise-after=2")


def test_the_exit_status_is_the_job_s(segfault: Run) -> None:
    assert segfault.code == 1, segfault.stderr[-3000:]


def test_the_postmortem_names_the_rank_s_own_sigsegv(segfault: Run) -> None:
    doc = only_postmortem(segfault.tmp_path)
    assert doc["killer"]["kind"] == "segfault" and doc["victim"]["rank"] == 1, doc["killer"]
    assert doc["victim"]["signal"] == "SIGSEGV" and doc["victim"]["exit_code"] == -11
    if not met("tracefs"):
        left_out("tracefs", "the kernel raising the SIGSEGV for the rank's own fault, certain")
    else:  # the tracepoint shows the kernel raised it for the rank's own fault
        assert doc["killer"]["confidence"] == "certain", doc["killer"]
        assert any("the rank itself raised SIGSEGV" in e["detail"] for e in doc["killer"]["evidence"])
    survivor = next(r for r in doc["ranks"] if r["rank"] == 0)
    assert survivor_fate_right(survivor, segfault.stderr), doc["ranks"]


def test_it_is_named_live_and_from_its_logs(segfault: Run) -> None:
    assert segfault.code != 0, segfault.stderr[-3000:]
    live = only_postmortem(segfault.tmp_path)
    offline, _output = diagnose_job_output(segfault.tmp_path, segfault.stderr)
    named_alike(live, offline, "segfault", 1)
