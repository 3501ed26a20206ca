"""How long ``trainwatch story`` takes on a 64-node job: the whole CLI process (Python's
start included), and ``GET /story`` on a real daemon started with ``--prometheus``.

    python benchmarks/story_scale.py [--nodes 64] [--ranks-per-node 8] [--repeat 7]

The cluster is simulated from the recorded real two-node run (tests/fixtures/story/, see
tests/storyfakes.Cluster): every node's daemon is a real HTTP server on its own loopback
port serving that run's recorded postmortems (one node's rank killed by its memory
cgroup, every other node's ranks following it), with 8 ranks a node and a 600-sample
timeline each; the Prometheus API answers the story's queries with every node's deaths,
ranks and four minutes of clock samples. All of it, the simulated cluster and the story,
shares this machine's cores, so the figures bound what one story costs from above. Each
repetition asks for another job name, so ``/story``'s 5-second cache never answers.
Results: ``benchmarks/results/story.json`` (docs/story.md: "How long a story takes").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from tests.support.e2e import REPO, DaemonProc
from tests.support.storyfakes import Cluster


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--name", default="story")
    args = ap.parse_args()
    cluster = Cluster(args.nodes, args.ranks_per_node)
    cli: list[float] = []
    http: list[float] = []
    answer: dict[str, object] = {}
    with cluster.serve() as prom, tempfile.TemporaryDirectory() as tmp:
        idle = subprocess.Popen(["sleep", "3600"])
        try:
            with DaemonProc(Path(tmp), "--pid", str(idle.pid), "--prometheus", prom) as viewer:
                for i in range(args.repeat):
                    t0 = time.perf_counter()
                    out = subprocess.run(
                        [sys.executable, "-m", "sidecar", "story", "--prometheus", prom, "--job", f"cli-{i}",
                         "--format", "json"],
                        capture_output=True, text=True, cwd=REPO, timeout=120,
                    )  # fmt: skip
                    cli.append(time.perf_counter() - t0)
                    if out.returncode != 0:
                        raise SystemExit(f"story failed: {out.stderr}")
                    answer = json.loads(out.stdout)
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(f"{viewer.base}/story?job=http-{i}", timeout=120) as r:
                        body = r.read()
                    http.append(time.perf_counter() - t0)
                    assert json.loads(body)["first_death"]["rank"] == 0
        finally:
            idle.kill()
            idle.wait()
    ranks = answer.get("ranks")
    row = {
        "nodes": args.nodes,
        "ranks": len(ranks) if isinstance(ranks, list) else None,
        "repeat": args.repeat,
        "cli_seconds": {"median": statistics.median(cli), "max": max(cli), "all": cli},
        "http_seconds": {"median": statistics.median(http), "max": max(http), "all": http},
        "answer_bytes": len(json.dumps(answer)),
        "first_death": {k: answer["first_death"][k] for k in ("instance", "rank")}  # type: ignore[index]
        if isinstance(answer.get("first_death"), dict)
        else None,
        "goal_seconds": 2.0,
    }
    print(
        f"{args.nodes} nodes, {row['ranks']} ranks: CLI median {row['cli_seconds']['median']:.2f} s "  # type: ignore[index]
        f"(max {max(cli):.2f}), GET /story median {statistics.median(http):.2f} s (max {max(http):.2f})"
    )
    results.write(args.name, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
