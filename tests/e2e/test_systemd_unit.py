"""The systemd unit's capabilities, for real: the daemon run as the unit runs it (uid 0 with
exactly the unit's CapabilityBoundingSet) still names a rank's killer and its sender, and
protects itself as far as this machine's root may. The unit's files themselves are checked
in tests/unit/deploy/test_stack.py."""

from __future__ import annotations

import os
import re
import resource as resource_module
import subprocess
from pathlib import Path

import pytest

from tests.support.e2e import REPO, DaemonProc, TorchrunJob, job_postmortem, survivor_fate_right
from tests.support.skips import requires

UNIT = REPO / "deploy" / "systemd" / "trainwatch.service"


def _unit_capabilities() -> list[str]:
    (line,) = [x for x in UNIT.read_text().splitlines() if x.startswith("CapabilityBoundingSet=")]
    return line.split("=", 1)[1].split()


@pytest.mark.root
@requires("tracefs", "setpriv")
def test_the_units_capabilities_are_enough_to_name_a_killer(tmp_path):
    """The daemon as the unit runs it: uid 0 with only the unit's capabilities. A rank
    killed from outside is still discovered, its exit caught and its sender named."""
    caps = _unit_capabilities()
    assert caps == [
        "CAP_SYS_PTRACE",
        "CAP_DAC_READ_SEARCH",
        "CAP_SYSLOG",
        "CAP_NET_ADMIN",
        "CAP_SYS_RESOURCE",
        "CAP_IPC_LOCK",
        "CAP_SYS_NICE",
    ]
    bounding = "-all," + ",".join("+" + c.removeprefix("CAP_").lower() for c in caps)
    wrap = ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", "--"]
    with (
        DaemonProc(tmp_path, wrap=wrap) as daemon,
        TorchrunJob(tmp_path, "caps", hold_mb=50, workers=0) as job,
    ):
        status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
        (eff,) = re.findall(r"^CapEff:\s*(\w+)$", status, re.M)
        # ptrace, dac_read, syslog, net_admin, sys_resource, ipc_lock, sys_nice: those this
        # machine's root has (a sandbox may withhold some, e.g. CAP_SYS_RESOURCE)
        ours = int(re.findall(r"^CapBnd:\s*(\w+)$", Path("/proc/self/status").read_text(), re.M)[0], 16)
        wanted = sum(1 << n for n in (19, 2, 34, 12, 24, 14, 23))
        assert int(eff, 16) == wanted & ours, eff
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        killer = subprocess.run(
            ["sh", "-c", f"kill -9 {pids[1][0]}; echo $$"], capture_output=True, text=True
        )
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        k = doc["killer"]
        assert (k["kind"], k["confidence"]) == ("external_signal", "certain"), k
        assert f"pid {killer.stdout.strip()} (sh)" in k["summary"], k
        rows = {r["rank"]: r for r in doc["ranks"]}
        assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0], job.output()), rows
        log = daemon.log()
        evidence_log = "\n".join(x for x in log.splitlines() if "self-protection:" not in x)
        assert "Permission denied" not in evidence_log and "Operation not permitted" not in evidence_log, log
        # and with them the daemon protects itself as the unit intends, as far as this
        # machine's root may (what it may not is logged, and exported as 0): a container's
        # root often lacks CAP_SYS_RESOURCE, CAP_IPC_LOCK or CAP_SYS_NICE (Docker's defaults)
        resource, nice = bool(ours >> 24 & 1), bool(ours >> 23 & 1)
        # mlockall needs CAP_IPC_LOCK, or an RLIMIT_MEMLOCK above the daemon's whole size
        memlock = resource_module.getrlimit(resource_module.RLIMIT_MEMLOCK)[0]
        lock = bool(ours >> 14 & 1) or memlock == resource_module.RLIM_INFINITY
        protected = {labels["kind"]: v for labels, v in daemon.metrics()["trainwatch_self_protection"]}
        want = {"oom_score_adj": int(resource), "mlock": int(lock), "priority": int(nice)}
        assert protected == want, protected
        # every thread at nice -10, those started after the grant too (HTTP, readers); without
        # CAP_SYS_NICE each keeps the nice it inherited from this process
        tasks = list(Path(f"/proc/{daemon.proc.pid}/task").iterdir())
        nices = {int(t.joinpath("stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks}
        assert nices == ({-10} if nice else {os.getpriority(os.PRIO_PROCESS, 0)}), (len(tasks), nices)
        adj = Path(f"/proc/{daemon.proc.pid}/oom_score_adj").read_text().strip()
        assert adj == ("-1000" if resource else "0"), adj
        if not resource:
            assert "self-protection: oom_score_adj not granted: cannot set -1000" in log, log[-3000:]
        assert daemon.stop() == 0
