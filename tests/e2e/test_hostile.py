"""A local user cannot blind the daemon or read through it: real torchrun jobs, run as
``nobody``, whose ranks name hostile files as their ``TORCHELASTIC_ERROR_FILE`` and
flight-recorder dump (a FIFO, a symbolic link to a root-only file, a character device, a
path through a linked directory into root's files), then die. Each death still gets its
postmortem, none of it holds what the root-only file holds, and the postmortem says which
file was not read and why. And credentials a rank prints or puts in its exception never
reach the postmortem, its HTML page or the daemon's log."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.e2e import DaemonProc, TorchrunJob, job_postmortem, python_for_user
from tests.support.skips import requires

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
MARKER = "TRAINWATCH-ROOT-ONLY-MARKER-7f3a"


@pytest.fixture
def playground() -> Iterator[Path]:
    """A directory the job's user may write (its ready files, its own hostile files)."""
    d = Path(tempfile.mkdtemp(prefix="tw-hostile-"))
    d.chmod(0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _attacks(play: Path, secret_dir: Path) -> dict[str, tuple[str, str, str]]:
    """name -> (error file path, flight-recorder dump prefix, the reason the daemon must give)."""
    (secret_dir / "marker").write_text(MARKER)
    (secret_dir / "trace_1").write_text(MARKER)
    for f in secret_dir.iterdir():
        f.chmod(0o600)
    os.mkfifo(play / "fifo-err")
    os.mkfifo(play / "fifo-trace_1")
    os.symlink(secret_dir / "marker", play / "link-err")
    os.symlink(secret_dir / "marker", play / "link-trace_1")
    os.mknod(play / "zero-trace_1", 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's twin
    os.symlink(secret_dir, play / "dirlink")
    for f in play.iterdir():
        os.lchown(f, NOBODY, NOBODY)  # the attacker's own files
    return {
        "fifo": (str(play / "fifo-err"), str(play / "fifo-trace_"), "a FIFO, not a regular file"),
        "link": (str(play / "link-err"), str(play / "link-trace_"), "a symbolic link (not followed)"),
        "devzero": ("/dev/zero", str(play / "zero-trace_"), "a character device, not a regular file"),
        "dirlink": (
            str(play / "dirlink" / "marker"),
            str(play / "dirlink" / "trace_"),
            f"owned by uid 0, not by the rank's user (uid {NOBODY})",
        ),
    }


@pytest.mark.quiet  # a round reads the job's files within 0.6 s: a starved CPU spends it first
@pytest.mark.root
@requires("other-user")
def test_hostile_files_named_by_a_job_neither_hang_nor_leak(tmp_path, playground):
    python, site = python_for_user(NOBODY) or ("", "")
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir(mode=0o700)
    attacks = _attacks(playground, secret_dir)
    jobs: dict[str, TorchrunJob] = {}
    try:
        for name, (error_file, trace, _) in attacks.items():
            jobs[name] = TorchrunJob(
                playground,
                f"job-{name}",
                mode=0o777,
                wrap=AS_NOBODY,
                env={"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": trace, "PYTHONPATH": site},
                python=python,
                hold_mb=30,
                workers=0,
                error_file=error_file,
            )
        ready = {name: job.ready() for name, job in jobs.items()}
        # the daemon starts after the ranks re-executed with their chosen paths
        with DaemonProc(tmp_path) as daemon:
            for name, job in jobs.items():
                daemon.wait_sampled(job, ready[name])
            latency = {}
            for name, job in jobs.items():
                killed = time.monotonic()
                os.kill(ready[name][1][0], signal.SIGKILL)
                doc = job_postmortem(daemon, victim_rank=1, want_fates=1, job=job)
                latency[name] = round(time.monotonic() - killed, 3)
                job.proc.wait(60)
                assert doc["killer"]["kind"] == "external_signal", (name, doc["killer"])
                skipped = [e["detail"] for e in doc["killer"]["evidence"] if e["source"] == "skipped"]
                error_file, trace, reason = attacks[name]
                assert f"error file {error_file} of rank 1 not read: {reason}" in skipped, (name, skipped)
                dump = f"flight-recorder dump {trace}1 of rank 1 not used: {reason}"
                assert dump in skipped, (name, skipped)
                status, html = daemon.get(f"/postmortems/{doc['id']}?format=html")
                assert status == 200 and MARKER not in html
                assert MARKER not in json.dumps(doc)
            print(f"death -> postmortem visible, per attack (s): {latency}")
            assert daemon.get("/healthz")[0] == 200  # nothing hung the daemon
            for f in (tmp_path / "postmortems").glob("*.json"):
                assert MARKER not in f.read_text()
            assert MARKER not in daemon.log() and "Traceback" not in daemon.log()
            assert daemon.stop() == 0
    finally:
        for job in jobs.values():
            job.__exit__(None, None, None)


@requires("root")
def test_credentials_a_rank_prints_never_leave_the_daemon(tmp_path):
    """The rank prints credentials, puts one in its exception and has one on its command
    line: the postmortem names the exception, with the credential's value redacted."""
    secrets = [
        "hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ012345",
        "0123456789abcdef0123456789abcdef01234567",
        "pgpass123SECRET",
        "hf_ZyXwVuTsRqPoNmLkJiHgFeDcBa543210",
        "hf_QwErTyUiOpAsDfGhJkLzXcVbNm987654",
        "hf_CommandLineTokenValue0123456789",
    ]
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(
            tmp_path,
            "secrets",
            hold_mb=30,
            workers=0,
            raise_rank=1,
            raise_after=1.0,
            print_secrets=1,
            hf_token=secrets[-1],
        ) as job,
    ):
        job.ready()
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
        killer = doc["killer"]
        assert (killer["kind"], killer["confidence"]) == ("python_exception", "certain"), killer
        assert "login failed for HF_TOKEN=<redacted>" in killer["summary"], killer["summary"]
        _, html = daemon.get(f"/postmortems/{doc['id']}?format=html")
        _, text = daemon.get(f"/postmortems/{doc['id']}?format=text")
        _, ranks = daemon.get("/ranks")
        assert "found torchrun agent" in daemon.log()  # the line that quotes the command line
        for secret in secrets:
            for where, body in (
                ("json", json.dumps(doc)),
                ("html", html),
                ("text", text),
                ("ranks", ranks),
                ("log", daemon.log()),
            ):
                assert secret not in body, (secret, where)
        assert daemon.stop() == 0
