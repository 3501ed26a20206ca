"""The unit suite's run on another machine as a results file:
    python benchmarks/unit_summary.py OUT_DIR NAME [--commit C]
reads what ``benchmarks/unit_elsewhere.sh`` left in OUT_DIR (``machine.txt``, ``junit.xml``)
and writes ``benchmarks/results/NAME.json``: the machine as that run saw it (kernel, cores,
page size, capabilities, cgroup version, /dev/kmsg, tracefs, /proc file sizes, Python,
torch, GPU), the counts, every failure and every skip with its reason.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results

CAP_SYS_RESOURCE = 24
CAP_SYS_ADMIN = 21


def _sections(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    name = ""
    for line in text.splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            out[name] = []
        elif name:
            out[name].append(line)
    return out


def machine_of(text: str) -> dict[str, Any]:
    s = _sections(text)
    uname = (s.get("uname") or [""])[0].split()
    caps = next((ln.split()[1] for ln in s.get("capabilities", []) if ln.startswith("CapEff")), None)
    eff = int(caps, 16) if caps else None
    cgroup = s.get("cgroup", [])
    sizes = {}
    for line in s.get("/proc sizes (bytes read)", []):
        path, _, size = line.rpartition(" ")
        if size.isdigit():
            sizes[path] = int(size)
    python = s.get("python", [])
    mem = next((ln.split()[1] for ln in s.get("memory", []) if ln.startswith("MemTotal:")), None)
    cpu = next((ln.split(":", 1)[1].strip() for ln in s.get("cpu", []) if ln.startswith("model name")), None)
    hierarchies = [ln for ln in cgroup if re.match(r"^\d+:", ln)]
    return {
        "cpu": cpu,
        "memory_bytes": int(mem) * 1024 if mem else None,
        "kernel": uname[2] if len(uname) > 2 else None,
        "cores": int(s["nproc"][0]) if s.get("nproc") else None,
        "page_size": int(s["page size"][0]) if s.get("page size") else None,
        "root": any("uid=0(" in ln for ln in s.get("id", [])),
        "cap_sys_resource": None if eff is None else bool(eff >> CAP_SYS_RESOURCE & 1),
        "cap_sys_admin": None if eff is None else bool(eff >> CAP_SYS_ADMIN & 1),
        "cgroup": "v2" if hierarchies and all(ln.startswith("0::") for ln in hierarchies) else "v1",
        "kmsg": any(ln.startswith("c") for ln in s.get("/dev/kmsg", [])),
        "tracefs": not any("cannot access" in ln for ln in s.get("tracefs", [])),
        "proc_sizes": sizes,
        "python": python[0].split()[0] if python else None,
        "torch": next((ln.split()[1] for ln in python if ln.startswith("torch ")), None),
        "gpu": [ln for ln in s.get("gpu", []) if ln.startswith("GPU ")],
    }


def summary(junit: str) -> dict[str, Any]:
    suite = ET.fromstring(junit)
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    failed, skipped = [], []
    for case in suite.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag in ("failure", "error"):
            bad = case.find(tag)
            if bad is not None:
                failed.append({"test": name, "message": (bad.get("message") or "")[:300]})
        skip = case.find("skipped")
        if skip is not None:
            skipped.append({"test": name, "reason": skip.get("message") or ""})
    total = int(suite.get("tests", 0))
    return {
        "tests": total,
        "passed": total - len(failed) - len(skipped),
        "failed": failed,
        "skipped": skipped,
        "seconds": round(float(suite.get("time", 0.0)), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("name")
    ap.add_argument("--commit", help="the commit the other machine's copy was at")
    args = ap.parse_args()
    m = machine_of((args.out_dir / "machine.txt").read_text())
    result = summary((args.out_dir / "junit.xml").read_text())
    if args.commit:
        os.environ["TRAINWATCH_COMMIT"] = args.commit
    results.write(
        args.name,
        {**result, "suite": 'pytest -m "not slow"'},
        machine_info={
            "cpu": m["cpu"],
            "cores": m["cores"],
            "memory_bytes": m["memory_bytes"],
            "kernel": m["kernel"],
            "python": m["python"],
            "seen": m,
        },
    )
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
