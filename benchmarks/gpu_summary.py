"""The GPU check's figures as a results file: what torch, trainwatch and nvidia-smi said
about each rank's GPU memory in one run of ``benchmarks/gpu_check.sh OUT``.

    python benchmarks/gpu_summary.py OUT

Reads ``OUT/torch_rank*.json`` (the ranks' own report), ``OUT/metrics.txt`` (trainwatch's
``/metrics`` taken while they held their memory) and ``OUT/nvidia-smi-*.csv``; writes
``benchmarks/results/gpu.json`` (or under ``TRAINWATCH_RESULTS_DIR``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import results


def main() -> int:
    out = Path(sys.argv[1])
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("torch_rank*.json"))]
    samples = [
        s for f in text_string_to_metric_families((out / "metrics.txt").read_text()) for s in f.samples
    ]
    pid_of_rank = {s.labels["rank"]: s.labels["pid"] for s in samples if s.name == "trainwatch_rank_info"}
    tw = {
        pid_of_rank.get(s.labels["rank"]): int(s.value)
        for s in samples
        if s.name == "trainwatch_rank_gpu_memory_bytes"
    }
    smi: dict[str, int] = {}
    for line in (out / "nvidia-smi-apps.csv").read_text().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 2 and cells[0].isdigit() and cells[1].isdigit():
            smi[cells[0]] = int(cells[1]) << 20  # pid, MiB
    gpu_line = (out / "nvidia-smi-gpu.csv").read_text().split(",")
    device_used_mib = int(gpu_line[0]) if gpu_line[0].strip().isdigit() else None
    device_used = next((int(s.value) for s in samples if s.name == "trainwatch_gpu_memory_used_bytes"), None)
    name = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    rows = []
    for r in ranks:
        pid = str(r["pid"])
        rows.append(
            {
                "rank": r["rank"],
                "torch_allocated_bytes": r["memory_allocated"],
                "torch_reserved_bytes": r["memory_reserved"],
                "trainwatch_bytes": tw.get(pid),
                "nvidia_smi_bytes": smi.get(pid),
                "torch_version": r["torch"],
            }
        )
    results.write(
        "gpu",
        {
            "device": name,
            "rows": rows,
            "device_used_bytes_trainwatch": device_used,
            "device_used_mib_nvidia_smi": device_used_mib,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
