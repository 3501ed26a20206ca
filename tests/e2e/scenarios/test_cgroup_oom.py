"""One real cgroup OOM, each view of it: a real torchrun job (gloo, CPU) in a 1.5 GiB memory
cgroup, watched by the real daemon; rank 1 leaks until the kernel kills it. The job dies
once, for the module; each test reads one view of that death: the postmortem's verdict,
its memory section, the file the daemon wrote, /metrics, the HTTP routes, the
`trainwatch postmortem` command, the HTML view in a real browser, and `trainwatch diagnose`
of the torchrun log and the kernel's own records (dmesg, in two styles).

Other cgroup OOMs are other deaths: without the kernel log (tests/e2e/test_deaths.py), under
other launchers (test_launchers.py), under `trainwatch run` (test_run.py), foreseen
(test_foresight.py, test_prometheus.py), while the daemon was down (test_faults.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup
from tests.support.browser import screenshot
from tests.support.e2e import DaemonProc, TorchrunJob, job_postmortem, survivor_fate_right
from tests.support.runs import diagnose_cli, kernel_dmesg
from tests.support.skips import left_out, met, requires

GIB = 1 << 30

pytestmark = [
    pytest.mark.root,
    requires("memcg", "kmsg"),
]


@dataclass(frozen=True)
class Oom:
    """The death, as the views read it: the daemon (still running) and the job it watched."""

    tmp_path: Path
    parent: Path  # the limited cgroup
    daemon: DaemonProc
    job: TorchrunJob
    pids: list[list[int]]  # each rank's pids, rank order
    doc: dict  # the daemon's postmortem
    job_status: int  # torchrun's exit status

    @property
    def victim(self) -> int:
        return self.pids[1][0]


@pytest.fixture(scope="module")
def oom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Oom]:
    tmp = tmp_path_factory.mktemp("cgroup-oom")
    with memory_cgroup(int(1.5 * GIB), "trainwatch-oom") as (_version, parent, child):
        wrap = join_cgroup(child)
        # rank 1 leaks 640 MiB/s (64 MiB every 0.1 s): near the limit the daemon reads every
        # 0.1 s, so the charge split it reports at the kill is at most a step behind (at the
        # workload's default 3.2 GiB/s the limit is crossed between two rounds)
        with (
            DaemonProc(tmp) as daemon,
            TorchrunJob(
                tmp,
                "oom",
                wrap=wrap,
                hold_mb=50,
                workers=0,
                grow_rank=1,
                grow_after=2,
                grow_interval=0.1,
            ) as job,
        ):
            pids = job.ready()
            doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
            status = job.proc.wait(60)
            yield Oom(tmp, parent, daemon, job, pids, doc, status)
            assert daemon.stop() == 0


def test_the_killer_is_the_cgroup_s_oom_with_certainty(oom: Oom) -> None:
    doc = oom.doc
    killer = doc["killer"]
    assert killer["kind"] == "cgroup_oom" and killer["confidence"] == "certain", killer
    assert f"/{oom.parent.name}" in killer["summary"]
    assert doc["victim"]["pid"] == oom.victim and doc["victim"]["signal"] == "SIGKILL"
    assert doc["victim"]["exit_code"] == -9
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0], oom.job.output()), rows
    assert any(e["source"] == "kmsg" and f"pid={oom.victim}" in e["detail"] for e in killer["evidence"])


def test_the_memory_section_names_the_limit_and_what_filled_it(oom: Oom) -> None:
    doc = oom.doc
    assert doc["memory"]["cgroup"]["limit_bytes"] == int(1.5 * GIB)
    assert doc["memory"]["cgroup"]["oom_kills"] == 1
    # what filled the limit: the growing rank's heap, anonymous memory. The split is the
    # last round's: it dominates the charge, and was read on the approach to the limit
    # (over half of the usage at the kill; a round late by a starved sampler on this
    # 2-core machine has been 0.65 of it at 640 MiB/s, so no tighter bound is a fact)
    charge = doc["memory"]["cgroup"]["charge"]
    parts = charge["anon_bytes"] + charge["file_bytes"] + charge["shmem_bytes"] + charge["kernel_bytes"]
    assert charge["anon_bytes"] > 0.8 * parts, charge
    assert charge["anon_bytes"] > 0.5 * doc["memory"]["cgroup"]["usage_bytes_at_death"], charge
    assert charge["shmem_bytes"] < 64 << 20, charge
    assert doc["timeline"], "the memory curve before death"
    assert any("limit" in a for a in doc["advice"])


def test_one_private_postmortem_file_is_written(oom: Oom) -> None:
    # (the daemon watches every job on the machine: count only this job's)
    files = [
        f
        for f in (oom.tmp_path / "postmortems").glob("*.json")
        if json.loads(f.read_text())["job"]["agent_pid"] == oom.job.agent_pid
    ]
    assert [f.name for f in files] == [oom.doc["id"] + ".json"]
    assert oct(files[0].stat().st_mode & 0o777) == "0o640"
    assert json.loads(files[0].read_text())["killer"]["kind"] == "cgroup_oom"


def test_the_metrics_count_the_deaths_at_their_times(oom: Oom) -> None:
    doc = oom.doc
    m = oom.daemon.metrics()
    key = doc["job"]["key"]
    # the survivor is counted under its fate's killer: the agent's teardown, or (its gloo
    # collective failed first for the killed peer: same_cause) the OOM's
    fate = next(r["fate"] for r in doc["ranks"] if r["rank"] == 0)
    theirs = "agent_teardown" if fate == "terminated_by_agent" else "cgroup_oom"
    mine = {labels["killer"]: v for labels, v in m["trainwatch_rank_deaths_total"] if labels["job"] == key}
    assert mine == ({"cgroup_oom": 1, theirs: 1} if theirs != "cgroup_oom" else {"cgroup_oom": 2}), mine
    times = {
        (labels["rank"], labels["killer"]): v
        for labels, v in m["trainwatch_rank_death_timestamp_seconds"]
        if labels["job"] == key
    }
    assert set(times) == {("1", "cgroup_oom"), ("0", theirs)}, times
    died = datetime.fromisoformat(doc["victim"]["died_at"]).timestamp()
    assert abs(times[("1", "cgroup_oom")] - died) < 1 and times[("0", theirs)] > died - 0.5
    assert m["trainwatch_postmortems_written_total"][0][1] >= 1


def test_the_routes_list_and_serve_it(oom: Oom) -> None:
    daemon, doc = oom.daemon, oom.doc
    listing = json.loads(daemon.get("/postmortems")[1])
    (entry,) = [e for e in listing if e["id"] == doc["id"]]
    assert entry["killer"]["kind"] == "cgroup_oom" and entry["victim"]["rank"] == 1
    assert json.loads(daemon.get(f"/postmortems/{doc['id']}")[1])["id"] == doc["id"]
    assert daemon.get("/postmortems/..%2F..%2Fetc%2Fpasswd")[0] == 404
    assert daemon.get("/postmortems/nope")[0] == 404
    assert daemon.get("/postmortem")[0] == 200  # the newest, whichever job it is of
    status, text = daemon.get(f"/postmortems/{doc['id']}?format=text")
    survivor = next(r for r in doc["ranks"] if r["rank"] == 0)
    assert status == 200 and "killer: cgroup_oom (certain)" in text and survivor["fate"] in text


def test_the_postmortem_command_reads_it_from_the_daemon_and_from_the_directory(oom: Oom) -> None:
    daemon, doc = oom.daemon, oom.doc
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "postmortem", f"{daemon.base}/postmortems/{doc['id']}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "killer: cgroup_oom (certain)" in out.stdout, out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "postmortem",
            "--postmortem-dir",
            str(oom.tmp_path / "postmortems"),
            doc["id"],
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(out.stdout)["id"] == doc["id"]


def test_the_html_view_renders_in_a_real_browser(oom: Oom, tmp_path: Path) -> None:
    status, page = oom.daemon.get(
        f"/postmortems/{oom.doc['id']}", {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    )
    assert status == 200 and page.startswith("<!doctype html>") and "<svg" in page
    if not met("chromium"):
        left_out("chromium", "the HTML postmortem rendered in a real browser")
    else:
        png, chromium_log = screenshot(page, tmp_path, "postmortem-cgroup-oom")
        assert png.exists() and png.stat().st_size > 20_000, chromium_log
        assert "Refused to" not in chromium_log and "Uncaught" not in chromium_log, chromium_log


def test_diagnose_names_it_from_the_torchrun_log_and_dmesg(oom: Oom, tmp_path: Path) -> None:
    """The logs alone, as a user pastes them after the fact: the agent's log and the
    kernel's records, as a file (dmesg) and on stdin (dmesg -T)."""
    assert oom.job_status != 0
    victim, pids = oom.victim, oom.pids
    log = oom.job.dir / "torchrun.log"
    deadline = time.monotonic() + 10  # the kernel's records are there by the time torchrun ended
    while f"pid={victim}" not in kernel_dmesg() and time.monotonic() < deadline:
        time.sleep(0.2)
    raw = tmp_path / "dmesg.txt"
    raw.write_text(kernel_dmesg())
    for args, stdin in (((str(log), str(raw)), ""), (("-", str(log)), kernel_dmesg("-T"))):
        rc, out, err = diagnose_cli("--format", "json", *args, stdin=stdin)
        assert rc == 0, err
        doc = json.loads(out)
        k = doc["killer"]
        assert (k["kind"], k["confidence"]) == ("cgroup_oom", "certain"), k
        assert f"/{oom.parent.name}" in k["summary"], k["summary"]
        assert doc["victim"]["pid"] == victim and doc["victim"]["exit_code"] == -9
        rows = {r["pid"]: r for r in doc["ranks"]}
        assert rows[victim]["fate"] == "root_cause", rows
        assert survivor_fate_right(rows[pids[0][0]], oom.job.output()), rows
        assert any(e["source"] == "kmsg" and f"pid={victim}" in e["detail"] for e in k["evidence"])
        kinds = " ".join(" ".join(i["kinds"]) for i in doc["inputs"])
        assert "torchrun agent (torch 2.4+)" in kinds and re.search(r"kernel log \(dmesg( -T)?\)", kinds)
    rc, text, _ = diagnose_cli(str(log), str(raw))
    assert rc == 0 and "(from logs)\n" in text and "\nkiller: cgroup_oom (certain)\n" in text, text
