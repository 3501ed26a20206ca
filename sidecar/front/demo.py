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
from collections.abc import Iterator
from pathlib import Path

__all__ = ["join_cgroup", "memory_cgroup", "memory_hierarchy", "run_demo"]

LIMIT_BYTES = 1536 << 20


def memory_hierarchy() -> tuple[int, Path] | None:
    """(version, root) of a memory cgroup hierarchy this process may create groups in, or
    None (not root, or no memory controller mounted where it can be used)."""
    if os.geteuid() != 0:
        return None
    v2 = Path("/sys/fs/cgroup")
    sub = v2 / "cgroup.subtree_control"
    if sub.exists() and "memory" in sub.read_text().split():
        return 2, v2
    v1 = v2 / "memory"
    return (1, v1) if (v1 / "cgroup.procs").exists() else None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int | None, prefix: str = "trainwatch") -> Iterator[tuple[int, Path, Path]]:
    """A parent memory cgroup limited to ``limit_bytes`` (None: no limit) and an unlimited
    child ``job`` in it (put processes there with ``join_cgroup``); both removed afterwards.
    Raises OSError saying why when none can be made."""
    found = memory_hierarchy()
    if found is None:
        raise OSError(1, "not root, or no memory cgroup hierarchy to create a group in")
    version, root = found
    parent = root / f"{prefix}-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    child = parent / "job"
    try:
        if version == 1:
            if limit_bytes is not None:
                (parent / "memory.limit_in_bytes").write_text(str(limit_bytes))
        else:
            if limit_bytes is not None:
                (parent / "memory.max").write_text(str(limit_bytes))
            (parent / "cgroup.subtree_control").write_text("+memory")
        child.mkdir()
        yield version, parent, child
    finally:
        for d in (child, parent):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still holds exiting tasks
                    time.sleep(0.1)


def join_cgroup(child: Path) -> list[str]:
    """A command prefix that moves the command into ``child`` before it execs."""
    return ["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$@"', "sh"]


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
    tmp = Path(tempfile.mkdtemp(prefix="trainwatch-demo-"))
    with contextlib.ExitStack() as stack:
        try:
            _, parent, child = stack.enter_context(memory_cgroup(LIMIT_BYTES, "trainwatch-demo"))
        except OSError as exc:
            print(
                f"trainwatch demo: {exc.strerror}; rank 1 will be killed with SIGKILL from outside instead."
            )
            return _demo(tmp, None)
        print(
            f"trainwatch demo: rank 1 will grow past the {LIMIT_BYTES >> 20} MiB limit of memory cgroup "
            f"{parent.name}."
        )
        return _demo(tmp, child)


def _demo(tmp: Path, child: Path | None) -> int:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
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
            # only the job this demo starts (the agents below this process): on a training
            # node the demo's daemon never attaches to anyone's real job
            "--pid",
            str(os.getpid()),
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
            "sidecar.front.demo_worker",
        ]
        if child is not None:
            cmd = [*join_cgroup(child), *cmd, "grow"]
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
        if child is None and victim is not None:
            time.sleep(3)
            os.kill(victim, signal.SIGKILL)
        doc = None
        while time.monotonic() < deadline:
            status, body = _get(base + "/postmortems")
            for entry in json.loads(body) if status == 200 else []:
                status, one = _get(f"{base}/postmortems/{entry['id']}")
                candidate = json.loads(one) if status == 200 else None
                if candidate and candidate["job"]["agent_pid"] == job.pid:  # this demo's job, not another's
                    doc = candidate
                    break
            if doc is not None and all(r["fate"] not in ("running", "unknown") for r in doc["ranks"]):
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
        status, text = _get(f"{base}/postmortems/{doc['id']}?format=text")
        print()
        print(text)
        path = tmp / "postmortems" / f"{doc['id']}.json"
        status, page = _get(f"{base}/postmortems/{doc['id']}?format=html")
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
