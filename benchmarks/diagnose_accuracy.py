"""How often `trainwatch diagnose` names the killer of the public-log cases, and whether it
is ever confidently wrong.

    python benchmarks/diagnose_accuracy.py [CASES.jsonl] [--name NAME]

Reads tests/fixtures/public-logs/cases.jsonl (one real incident a line, from public issue
threads, with the cause the thread supports and the thread's URL) and prints, per case, the
truth, the answer and its confidence, then the accuracy and the count of wrong answers
given as `certain` or `likely` (the target is zero). A case about a rank the torchrun agent
tore down is answered by that rank's fate. Results, with the per-case table:
``benchmarks/results/NAME.json`` (default ``diagnose``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from tests.test_diagnose_units import CASES, CONFIDENT, score


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
            f"{'ok  ' if ok else 'MISS'} {case['id']:<48} truth {case['ground_truth']:<18} "
            f"answer {kind} ({confidence})"
        )
    right = sum(r["right"] for r in rows)
    wrong_confident = sum(r["confident_wrong"] for r in rows)
    decisive = [r for r in rows if r["decisive"]]
    per_kind: dict[str, dict[str, int]] = {}
    for r in rows:
        k = per_kind.setdefault(r["truth"], {"cases": 0, "right": 0, "decisive": 0, "decisive_right": 0})
        k["cases"] += 1
        k["right"] += r["right"]
        k["decisive"] += r["decisive"]
        k["decisive_right"] += r["decisive"] and r["right"]
    for kind, k in sorted(per_kind.items()):
        print(f"  {kind:<20} {k['right']}/{k['cases']} right; decisive {k['decisive_right']}/{k['decisive']}")
    print(
        f"\naccuracy: {right}/{len(rows)} ({100 * right / len(rows):.0f} %); "
        f"confidently wrong (certain or likely): {wrong_confident}"
    )
    try:
        shown = str(path.resolve().relative_to(results.REPO))
    except ValueError:
        shown = str(path)
    results.write(
        args.name,
        {
            "cases_file": shown,
            "cases": len(rows),
            "right": right,
            "confident_wrong": wrong_confident,
            "decisive": len(decisive),
            "decisive_right": sum(r["right"] for r in decisive),
            "per_kind": per_kind,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
