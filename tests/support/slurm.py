"""A real Slurm for the tests on this machine: Debian's munged, slurmctld and one slurmd for
each of two nodes (``NODES``: two slurmd on one host, each told its node by ``-N``, with its
own port, spool, pid file and log), from a private configuration (its own munge key and
socket, its own ports, state and logs under one folder), with ``task/cgroup`` and
``ConstrainRAMSpace=yes``: a step's ``--mem`` is a real memory cgroup limit (cgroup v1 or v2,
whichever holds the memory controller here), below each node's own ``slurm_<node>``. A step
of ``--nodes=2`` has a slurmstepd on each node, as on two machines.

Started once per machine and checkout by the first test that needs it (``cluster()``, under
a lock: the test workers share it) and stopped at the end of the run (``stop()``: the
controller's ``pytest_sessionfinish`` in tests/conftest.py, and ``python -m tests.support.slurm
--stop``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.ports import free_port

# one cluster per checkout: two checkouts testing on one machine (a developer's and a CI
# trial's) never stop or reconfigure each other's, nor share node names (whose cgroups,
# /slurm_<node>, would collide)
_CHECKOUT = hashlib.sha1(str(Path(__file__).resolve().parents[2]).encode()).hexdigest()[:6]
DIR = Path(os.environ.get("TRAINWATCH_SLURM_DIR", f"/tmp/trainwatch-slurm-{_CHECKOUT}"))
CONF = DIR / "slurm.conf"
NODES = (f"tw{_CHECKOUT}a", f"tw{_CHECKOUT}b")
DAEMONS = (*(f"slurmd-{n}" for n in NODES), "slurmctld", "munged")  # stopped in this order
BINARIES = ("munged", "slurmctld", "slurmd", "srun", "scancel", "sinfo", "scontrol")


def available() -> bool:
    """Whether this machine can run it: the binaries, and root (slurmd runs the tasks)."""
    return os.geteuid() == 0 and all(shutil.which(b) or Path(f"/usr/sbin/{b}").exists() for b in BINARIES)


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def env() -> dict[str, str]:
    """The environment srun, scancel and sinfo need to reach this cluster."""
    return dict(os.environ, SLURM_CONF=str(CONF))


def _write_config() -> None:
    host = socket.gethostname().split(".")[0]
    mem_mib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_mib = int(line.split()[1]) // 1024
    cgroup = "cgroup/v1" if Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() else "cgroup/v2"
    shutil.rmtree(DIR / "state", ignore_errors=True)  # an earlier cluster's jobs and nodes
    for sub in ("state", "log", "run", *(f"spool/{n}" for n in NODES)):
        (DIR / sub).mkdir(parents=True, exist_ok=True)
    # each node the whole machine (the tests' steps are small)
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={os.cpu_count()} "
        f"RealMemory={mem_mib * 9 // 10} State=UNKNOWN"
        for n in NODES
    )
    key = DIR / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    CONF.write_text(
        f"""ClusterName=trainwatch
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmctldPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={DIR}/run/munge.sock
StateSaveLocation={DIR}/state
SlurmdSpoolDir={DIR}/spool/%n
SlurmctldPidFile={DIR}/run/slurmctld.pid
SlurmdPidFile={DIR}/run/slurmd-%n.pid
SlurmctldLogFile={DIR}/log/slurmctld.log
SlurmdLogFile={DIR}/log/slurmd-%n.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MpiDefault=none
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
KillWait=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""
    )
    (DIR / "cgroup.conf").write_text(
        f"CgroupPlugin={cgroup}\nConstrainRAMSpace=yes\nConstrainSwapSpace=no\nConstrainCores=no\n"
    )


def _states() -> dict[str, str] | None:
    """Each node's state as the controller tells it (None: no controller answers)."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %T"], env=env(), capture_output=True, text=True, timeout=10
    )
    if out.returncode != 0:
        return None
    return dict(line.split(None, 1) for line in out.stdout.splitlines() if len(line.split()) == 2)


def _running() -> bool:
    """Every node's slurmd up: any state but down or unknown (a node may be completing a
    step, or drained after one; steps of other tests may be running on it)."""
    states = _states()
    if states is None or set(states) != set(NODES):
        return False
    return not any(
        state.rstrip("*").startswith(("down", "unknown", "not_responding")) for state in states.values()
    )


def _resume_drained() -> None:
    """A node Slurm drained (a step it could not end in time, on a loaded machine) takes no
    step: put it back, as an administrator would."""
    for node, state in (_states() or {}).items():
        if "drain" in state:
            subprocess.run(
                ["scontrol", "update", f"nodename={node}", "state=resume"],
                env=env(),
                capture_output=True,
                timeout=10,
            )


def cluster(timeout: float = 60) -> dict[str, str]:
    """Start the cluster unless it runs; the environment to reach it."""
    DIR.mkdir(parents=True, exist_ok=True)
    with open(DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if CONF.exists() and _running():
            _resume_drained()
            return env()
        stop()
        _write_config()
        run = DIR / "run"
        subprocess.run(
            [
                _binary("munged"), "--force", f"--socket={run}/munge.sock", f"--key-file={DIR}/munge.key",
                f"--log-file={DIR}/log/munged.log", f"--pid-file={run}/munged.pid",
                f"--seed-file={DIR}/state/munge.seed",
            ],
            check=True,
        )  # fmt: skip
        subprocess.run([_binary("slurmctld"), "-f", str(CONF)], check=True, env=env())
        for node in NODES:
            subprocess.run([_binary("slurmd"), "-f", str(CONF), "-N", node], check=True, env=env())
        deadline = time.monotonic() + timeout
        while not _running():
            if time.monotonic() > deadline:
                logs = "\n".join(
                    (DIR / "log" / n).read_text()[-2000:]
                    for n in ("slurmctld.log", *(f"slurmd-{node}.log" for node in NODES))
                )
                raise RuntimeError(f"the test Slurm did not come up in {timeout:.0f} s:\n{logs}")
            time.sleep(0.2)
        return env()


def _ours() -> list[int]:
    """The daemons running from this cluster's folder, whatever their pid files say (a
    daemon started again over a stale pid file leaves the older one running)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if any(str(DIR).encode() + b"/" in a for a in argv[1:]):
                found.append(int(entry.name))
    return found


def stop() -> None:
    """Stop the cluster's daemons (slurmd first, then slurmctld, then munged), if any run."""
    for name in DAEMONS:
        pidfile = DIR / "run" / f"{name}.pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.05)
        with contextlib.suppress(OSError):
            pidfile.unlink()
    for pid in _ours():  # any left over
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    if sys.argv[1:] == ["--stop"]:
        stop()
    else:
        print(cluster()["SLURM_CONF"])
