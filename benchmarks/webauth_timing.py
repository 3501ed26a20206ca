"""Whether a refusal's time tells which user names exist: a real daemon with
``--web-config`` basic auth (two users, bcrypt cost 10), refused requests of a known user
with a wrong password and of unknown users, sent in turns; their medians and ratio, and
the cost of a scrape whose good password was checked before (the cache).

    python benchmarks/webauth_timing.py [--rounds 40] [--baseline REV]

Results: ``benchmarks/results/webauth-timing.json`` (docs/web-config.md).
"""

from __future__ import annotations

import argparse
import base64
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bcrypt

from benchmarks import results
from tests.support.e2e import REPO, DaemonProc


def timed(url: str, user: str, password: str) -> tuple[float, int]:
    req = urllib.request.Request(url)
    req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        e.close()
        status = e.code
    return time.perf_counter() - t0, status


def measure(rounds: int, cwd: Path | None) -> dict[str, float]:
    """The medians for a daemon of the tree at ``cwd`` (None: this checkout)."""
    with tempfile.TemporaryDirectory() as tmp:
        web = Path(tmp) / "web.yml"
        hashes = [bcrypt.hashpw(p, bcrypt.gensalt(rounds=COST)).decode() for p in (b"s3cret", b"other")]
        web.write_text(f"basic_auth_users:\n  prometheus: '{hashes[0]}'\n  grafana: '{hashes[1]}'\n")
        idle = subprocess.Popen(["sleep", "3600"])
        try:
            with DaemonProc(Path(tmp), "--pid", str(idle.pid), "--web-config", str(web), cwd=cwd) as daemon:
                url = daemon.base + "/metrics"
                timed(url, "prometheus", "s3cret")  # the good pair, checked once and remembered
                known, unknown, cached = [], [], []
                for i in range(rounds):
                    t, status = timed(url, "prometheus", f"wrong{i}")
                    assert status == 401
                    known.append(t)
                    t, status = timed(url, f"nobody{i}", f"wrong{i}")
                    assert status == 401
                    unknown.append(t)
                    t, status = timed(url, "prometheus", "s3cret")
                    assert status == 200
                    cached.append(t)
        finally:
            idle.kill()
            idle.wait()
    return {
        "known_user_refused_ms": statistics.median(known) * 1000,
        "unknown_user_refused_ms": statistics.median(unknown) * 1000,
        "ratio_unknown_to_known": statistics.median(unknown) / statistics.median(known),
        "good_pair_remembered_ms": statistics.median(cached) * 1000,
    }


COST = 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--baseline", metavar="REV", help="also measure the daemon of this commit, before")
    ap.add_argument("--name", default="webauth-timing")
    args = ap.parse_args()
    row: dict[str, object] = {"bcrypt_cost": COST, "rounds": args.rounds}
    if args.baseline:
        with tempfile.TemporaryDirectory() as tree:
            subprocess.run(["git", "worktree", "add", "--detach", tree, args.baseline], check=True,
                           capture_output=True, cwd=REPO)  # fmt: skip
            try:
                row["baseline"] = {"commit": args.baseline, **measure(args.rounds, Path(tree))}
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", tree], capture_output=True, cwd=REPO)
    now = measure(args.rounds, None)
    row.update(now)
    for label, r in (("before", row.get("baseline")), ("now", now)):
        if isinstance(r, dict):
            print(
                f"{label}: refused known user {r['known_user_refused_ms']:.1f} ms, unknown user "
                f"{r['unknown_user_refused_ms']:.1f} ms (ratio {r['ratio_unknown_to_known']:.2f}); "
                f"a remembered good pair {r['good_pair_remembered_ms']:.2f} ms"
            )
    results.write(args.name, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
