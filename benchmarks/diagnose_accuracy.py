"""How often `trainwatch diagnose` names the killer of the public-log cases, and whether it
is ever confidently wrong, on each half of the corpus.

    python benchmarks/diagnose_accuracy.py [CASES.jsonl] [--name NAME]

Reads tests/fixtures/public-logs/cases.jsonl (one real incident a line, from public issue
threads, with the cause the thread supports, the thread's URL, the torch version and the
launcher). The corpus is split by a fixed hash of each thread's URL (tests/support/corpus.py): the
`dev` half may be read while writing rules, the `held_out` half is only scored here. Prints,
per case, the truth, the answer and its confidence, then per half, per kind and per
launcher: the cases right, the decisive ones right (those whose excerpt holds the record
that decides the label) and the wrong answers given as `certain` or `likely` (the target is
zero). A case about a rank the torchrun agent tore down is answered by that rank's fate.
Results, with the per-case table: ``benchmarks/results/NAME.json`` (default ``diagnose``).
Held-out cases are listed by id and URL only: their texts are not printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from tests.support.corpus import HALVES, half
from tests.support.paths import PUBLIC_CASES as CASES
from tests.support.scoring import CONFIDENT, score


def _tally(rows: list[dict[str, Any]]) -> dict[str, int]:
    decisive = [r for r in rows if r["decisive"]]
    return {
        "cases": len(rows),
        "right": sum(r["right"] for r in rows),
        "decisive": len(decisive),
        "decisive_right": sum(r["right"] for r in decisive),
        "confident_wrong": sum(r["confident_wrong"] for r in rows),
    }


def _by(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, int]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r[key]), []).append(r)
    return {name: _tally(group) for name, group in sorted(groups.items())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="?", default=str(CASES))
    ap.add_argument("--name", default="diagnose", help="results file name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    path = Path(args.cases)
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for case in cases:
        kind, confidence, _ = score(case)
        ok = kind == case["ground_truth"]
        rows.append(
            {
                "id": case["id"],
                "source": case["source"],
                "half": half(case["source"]),
                "launcher": case.get("launcher") or "unknown",
                "torch_version": case.get("torch_version"),
                "collected": case.get("collected") or "2026-12-03 or before",
                "truth": case["ground_truth"],
                "label_confidence": case["confidence"],
                "answer": kind,
                "confidence": confidence,
                "right": ok,
                "confident_wrong": (not ok) and confidence in CONFIDENT,
                "decisive": bool(case.get("decisive", True)),
            }
        )
        print(
            f"{'ok  ' if ok else 'MISS'} {rows[-1]['half']:<8} {case['id']:<48} "
            f"truth {case['ground_truth']:<18} answer {kind} ({confidence})"
        )
    halves: dict[str, Any] = {}
    for name in HALVES:
        mine = [r for r in rows if r["half"] == name]
        halves[name] = {**_tally(mine), "per_kind": _by(mine, "truth"), "per_launcher": _by(mine, "launcher")}
        t = halves[name]
        print(
            f"\n{name}: {t['right']}/{t['cases']} right; decisive {t['decisive_right']}/{t['decisive']}; "
            f"confidently wrong (certain or likely): {t['confident_wrong']}"
        )
        for group in ("per_kind", "per_launcher"):
            for key, k in t[group].items():
                print(
                    f"  {key:<24} {k['right']}/{k['cases']} right; "
                    f"decisive {k['decisive_right']}/{k['decisive']}"
                )
    # the held-out cases no one had read when any rule was written: collected after the split
    # (2026-12-04); collected by an outside collector after issue 40's families were written
    # (2026-12-06 and since: both halves, and the held-out half alone)
    for key, said, wanted in (
        ("held_out_unseen", "held_out, collected after the split", ("held_out", "2026-12-04", False)),
        ("collected_wave4", "both halves, collected after the wave-4 families", (None, "2026-12-06", True)),
        ("held_out_wave4", "held_out, collected after the wave-4 families", ("held_out", "2026-12-06", True)),
    ):
        which, day, since = wanted
        mine = [
            r
            for r in rows
            if (r["collected"] >= day if since else r["collected"] == day)
            and (which is None or r["half"] == which)
        ]
        if not mine:
            continue
        halves[key] = t = _tally(mine)
        print(
            f"\n{said}: {t['right']}/{t['cases']} right; "
            f"decisive {t['decisive_right']}/{t['decisive']}; confidently wrong: {t['confident_wrong']}"
        )
    total = _tally(rows)
    try:
        shown = str(path.resolve().relative_to(results.REPO))
    except ValueError:
        shown = str(path)
    results.write(
        args.name,
        {
            "cases_file": shown,
            "split": "sha256 of the thread URL (fragment and trailing slash removed), "
            "first byte even: dev, odd: held_out",
            **total,
            "per_kind": _by(rows, "truth"),
            "per_launcher": _by(rows, "launcher"),
            "halves": halves,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
