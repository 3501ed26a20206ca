"""``trainwatch demo``: a small real torchrun job (gloo, CPU) in which rank 1 exceeds a
real memory limit, with the daemon attached; it ends by printing the postmortem and
where to open its HTML view.

The limit is a memory cgroup the demo creates (v1 or v2, as root with a writable
hierarchy) and removes afterwards. When it cannot create one, it says why and kills
rank 1 with SIGKILL from outside instead, so the postmortem shows an ``external_signal``.
Needs torch (the job is a real torchrun job); the daemon itself does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

__all__ = ["run_demo"]

LIMIT_BYTES = 1536 << 20


def _make_cgroup() -> tuple[Path | None, str]:
    if os.geteuid() != 0:
        return None, "not root, so no memory cgroup can be created"
    v2 = Path("/sys/fs/cgroup")
    v1 = Path("/sys/fs/cgroup/memory")
    name = f"trainwatch-demo-{uuid.uuid4().hex[:6]}"
    try:
        if (v2 / "cgroup.subtree_control").exists() and "memory" in (
            v2 / "cgroup.subtree_control"
        ).read_text().split():
            parent = v2 / name
            parent.mkdir()
            (parent / "memory.max").write_text(str(LIMIT_BYTES))
            (parent / "cgroup.subtree_control").write_text("+memory")
        elif (v1 / "cgroup.procs").exists():
            parent = v1 / name
            parent.mkdir()
            (parent / "memory.limit_in_bytes").write_text(str(LIMIT_BYTES))
        else:
            return None, "no writable memory cgroup hierarchy here"
        (parent / "job").mkdir()
        return parent, ""
    except OSError as exc:
        return None, f"cannot create a memory cgroup: {exc.strerror}"


def _remove(parent: Path) -> None:
    for d in (parent / "job", parent):
        for _ in range(100):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def run_demo() -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("trainwatch demo: needs torch to run a real torchrun job (pip install torch)", file=sys.stderr)
        return 2
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    tmp = Path(tempfile.mkdtemp(prefix="trainwatch-demo-"))
    parent, why = _make_cgroup()
    if parent is None:
        print(f"trainwatch demo: {why}; rank 1 will be killed with SIGKILL from outside instead.")
    else:
        print(
            f"trainwatch demo: rank 1 will grow past the {LIMIT_BYTES >> 20} MiB limit of memory cgroup "
            f"{parent.name}."
        )
    log = open(tmp / "daemon.log", "w")  # noqa: SIM115
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "--attach-torchrun",
            "--port",
            "0",
            "--interval",
            "0.5",
            "--postmortem-dir",
            str(tmp / "postmortems"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    job = None
    try:
        base = None
        for _ in range(150):
            m = re.search(r"serving (http://[\d.]+:\d+)/metrics", (tmp / "daemon.log").read_text())
            if m:
                base = m.group(1)
                break
            if daemon.poll() is not None:
                break
            time.sleep(0.1)
        if base is None:
            print(
                "trainwatch demo: the daemon did not start:\n" + (tmp / "daemon.log").read_text(),
                file=sys.stderr,
            )
            return 1
        print(f"trainwatch demo: daemon at {base}; starting torchrun --standalone --nproc-per-node=2 ...")
        cmd = [
            torchrun,
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "-m",
            "sidecar.demo_worker",
        ]
        if parent is not None:
            cmd = ["sh", "-c", f'echo $$ > {parent / "job"}/cgroup.procs && exec "$@"', "sh", *cmd, "grow"]
        out = open(tmp / "torchrun.log", "w")  # noqa: SIM115
        job = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
        victim = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status, body = _get(base + "/ranks")
            if status == 200:
                ranks = [r for j in json.loads(body)["jobs"] if j["agent_pid"] == job.pid for r in j["ranks"]]
                victim = next((r["pid"] for r in ranks if r["rank"] == 1), None)
                if len(ranks) == 2:
                    break
            time.sleep(0.3)
        if parent is None and victim is not None:
            time.sleep(3)
            os.kill(victim, signal.SIGKILL)
        doc = None
        while time.monotonic() < deadline:
            status, body = _get(base + "/postmortem")
            if status == 200:
                doc = json.loads(body)
                if all(r["fate"] not in ("running", "unknown") for r in doc["ranks"]):
                    break
            time.sleep(0.3)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(60)
        if doc is None:
            print(
                "trainwatch demo: no postmortem arrived; the daemon's log:\n"
                + (tmp / "daemon.log").read_text(),
                file=sys.stderr,
            )
            return 1
        status, text = _get(base + "/postmortem?format=text")
        print()
        print(text)
        path = tmp / "postmortems" / f"{doc['id']}.json"
        status, page = _get(base + "/postmortem?format=html")
        html_path = tmp / "postmortem.html"
        html_path.write_text(page)
        print(f"Open the HTML view, with the memory chart: {html_path.as_uri()}")
        print(f"The document: {path}  (print it again: trainwatch postmortem {path})")
        return 0
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        daemon.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.wait(15)
        log.close()
        if parent is not None:
            _remove(parent)
