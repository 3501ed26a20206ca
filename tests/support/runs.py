"""`trainwatch run -- torchrun ...` of tests/workloads/rank.py for real (two ranks, gloo on
CPU, the postmortem in TMP/pm), and `trainwatch diagnose` of what that job printed: the
live verdict and the one from the logs alone, of one death."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.support.e2e import REPO, TORCHRUN, WORKLOAD

# a private /dev/shm of 1 MiB: the job in its own mount namespace (root: unshare -m, mount)
PRIVATE_SHM = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"', "sh"]


def trainwatch_run(
    tmp: Path, *workload: str, wrap: list[str] | None = None, timeout: float = 180
) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `trainwatch run` of a two-rank torchrun job of
    rank.py given these options, its postmortems written to ``tmp/pm``."""
    cmd = [
        sys.executable,
        "-m",
        "sidecar",
        "run",
        "--postmortem-dir",
        str(tmp / "pm"),
        "--interval",
        "0.5",
        "--",
        *(wrap or []),
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "--monitor-interval=0.1",
        str(WORKLOAD),
        "--hold-mb=30",
        "--workers=0",
        "--duration=120",
        *workload,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    return out.returncode, out.stdout, out.stderr


def only_postmortem(tmp: Path) -> dict:
    """The one postmortem the run wrote (there must be exactly one)."""
    files = sorted((tmp / "pm").glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def fates(doc: dict) -> dict[int, str]:
    return {r["rank"]: r["fate"] for r in doc["ranks"]}


def diagnose_cli(*args: str, stdin: str = "") -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``trainwatch diagnose ARGS``, ``stdin`` given it."""
    r = subprocess.run(
        [sys.executable, "-m", "sidecar", "diagnose", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    return r.returncode, r.stdout, r.stderr


def kernel_dmesg(*flags: str) -> str:
    """The kernel's own records: other tests running beside this one write lines of their own
    into /dev/kmsg (user facility: an oomd kill, a flood), which are no part of this death."""
    return subprocess.run(
        ["dmesg", "--facility=kern", *flags], capture_output=True, text=True, check=True
    ).stdout


def write_kmsg(record: str) -> None:
    """Write one record into the kernel log (``<level>text``; user facility, as every write)."""
    fd = os.open("/dev/kmsg", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, f"{record}\n".encode())
    finally:
        os.close(fd)


def kmsg_mark(what: str) -> str:
    """Write a record of this test's own into the kernel log, before the death it makes, and
    return its text for ``kernel_dmesg_since``."""
    mark = f"trainwatch-test: {what} begins ({uuid.uuid4().hex})"
    write_kmsg(f"<6>{mark}")
    return mark


def kernel_dmesg_since(mark: str) -> str:
    """The kernel's own records from ``mark`` on, as `dmesg` prints them, the mark first: a
    kernel log of this test's time only. Without the mark, the log of a test that looks for
    what is *not* there depends on what ran before: a flood (test_faults) can leave the ring
    with no kernel record at all (no log of the time, honestly ``unknown``), and a pid reused
    since an older test's OOM kill would find that kill."""
    raw = subprocess.run(["dmesg", "--raw"], capture_output=True, text=True, check=True).stdout
    out: list[str] = []
    for line in raw.splitlines():
        m = re.match(r"<(\d+)>(.*)", line)
        if m is None:
            continue
        if mark in m[2]:
            out = [m[2]]
        elif out and int(m[1]) >> 3 == 0:  # facility 0: the kernel's own
            out.append(m[2])
    assert out, f"the mark is no longer in the kernel log: {mark}"
    return "\n".join(out) + "\n"


def diagnose_job_output(tmp: Path, stderr: str) -> tuple[dict, str]:
    """(diagnose's document of the job's output, that output): what the terminal showed of
    the job, kept in ``tmp/job.log``; trainwatch's own closing lines are not the job's."""
    job_output = "\n".join(line for line in stderr.splitlines() if not line.startswith("trainwatch: "))
    log = tmp / "job.log"
    log.write_text(job_output)
    diag = subprocess.run(
        [sys.executable, "-m", "sidecar", "diagnose", "--format", "json", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert diag.returncode == 0, diag.stderr
    return json.loads(diag.stdout), job_output


def run_and_diagnose(tmp: Path, *workload: str, wrap: list[str] | None = None) -> tuple[dict, dict, str]:
    """(the live postmortem of `trainwatch run`, diagnose's document of the job's output,
    that output)."""
    code, _out, err = trainwatch_run(tmp, *workload, wrap=wrap)
    assert code != 0, err[-3000:]
    live = only_postmortem(tmp)
    offline, job_output = diagnose_job_output(tmp, err)
    return live, offline, job_output


def named_alike(live: dict, offline: dict, kind: str, rank: int) -> None:
    """The live postmortem and diagnose's name the same kind of killer for the same rank,
    each with some confidence."""
    for name, doc in (("live", live), ("diagnose", offline)):
        assert doc["killer"]["kind"] == kind, (name, doc["killer"])
        assert doc["victim"]["rank"] == rank, (name, doc["victim"], doc["killer"])
        assert doc["killer"]["confidence"] in ("certain", "likely"), (name, doc["killer"])


@dataclass(frozen=True)
class Run:
    """One `trainwatch run` of a job that dies, kept for every view of its death: the folder
    it wrote in (``tmp_path/pm``: its postmortem), its exit status and its stderr (the job's
    output, trainwatch's closing lines among it)."""

    tmp_path: Path
    code: int
    stderr: str


def run_once(tmp: Path, *workload: str, wrap: list[str] | None = None) -> Run:
    code, _out, err = trainwatch_run(tmp, *workload, wrap=wrap)
    return Run(tmp, code, err)
