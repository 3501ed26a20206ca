"""How often `trainwatch diagnose` names the killer of the public-log cases, and whether it
is ever confidently wrong.

    python benchmarks/diagnose_accuracy.py [CASES.jsonl]

Reads ../shared/fixtures/public-logs/cases.jsonl (one real incident a line, from public
issue threads, with the cause the thread supports) and prints, per case, the truth, the
answer and its confidence, then the accuracy and the count of wrong answers given as
`certain` or `likely` (the target is zero). A case about a rank the torchrun agent tore
down is answered by that rank's fate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_diagnose_units import CASES, CONFIDENT, score


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else CASES
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    right = wrong_confident = 0
    for case in cases:
        kind, confidence, _ = score(case)
        ok = kind == case["ground_truth"]
        right += ok
        wrong_confident += (not ok) and confidence in CONFIDENT
        print(
            f"{'ok  ' if ok else 'MISS'} {case['id']:<48} truth {case['ground_truth']:<18} "
            f"answer {kind} ({confidence})"
        )
    print(
        f"\naccuracy: {right}/{len(cases)} ({100 * right / len(cases):.0f} %); "
        f"confidently wrong (certain or likely): {wrong_confident}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
