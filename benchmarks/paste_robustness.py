"""Whether `trainwatch diagnose`'s verdicts hold however a log was pasted.

    python benchmarks/paste_robustness.py [--name NAME] [CASES.jsonl ...]

Every case of the public corpus (every tests/fixtures/public-logs/cases*.jsonl, or the files
named) is diagnosed as collected, then again
with each perturbation of tests/support/pastes.py applied (a prefix family on every line, colours,
CRLF, wraps at 80 and 120 columns as a terminal and as a web page does, every input in one
file, one file per rank). A verdict is the killer's kind, its confidence and the victim's
rank; a perturbation changes a case when the kind or the confidence differs from the case
as collected, or the victim's rank when the case as collected named one (a prefix may name
the victim where the plain logs did not: srun's task id is a rank). Counted per
perturbation: the cases changed, and among them those that became wrong, right, or wrong
with confidence (`certain`/`likely` on a kind other than the label). Results:
``benchmarks/results/NAME.json`` (default ``pastes``), with the changed cases by id (the
held-out half's texts are never printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from sidecar.diagnose import LogInput, diagnose
from tests.support.corpus import half
from tests.support.pastes import PERTURBATIONS
from tests.support.paths import PUBLIC_CASES as CASES
from tests.support.scoring import CONFIDENT


def verdict(case: dict[str, Any], evidence: list[tuple[str, str]]) -> tuple[str, str, Any]:
    """(kind, confidence, victim rank) as the accuracy benchmark scores it: a case about a
    rank the agent tore down is answered by that rank's fate."""
    doc = diagnose([LogInput(f"{kind}-{i}", text) for i, (kind, text) in enumerate(evidence)])
    kind, confidence = doc["killer"]["kind"], doc["killer"]["confidence"]
    rank = case.get("failed_rank")
    if rank is not None:
        row = next((r for r in doc["ranks"] if rank in (r["rank"], r["local_rank"])), None)
        if row is not None and row["fate"] == "terminated_by_agent":
            kind, confidence = "agent_teardown", "certain"
    return kind, confidence, (doc.get("victim") or {}).get("rank")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="pastes", help="results file name (benchmarks/results/NAME.json)")
    ap.add_argument("cases", nargs="*", type=Path, help="cases files (default: every file of the corpus)")
    args = ap.parse_args()
    files = args.cases or sorted(CASES.parent.glob("cases*.jsonl"))
    cases = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    started = time.perf_counter()
    base = {c["id"]: verdict(c, [(e["kind"], e["text"]) for e in c["evidence"]]) for c in cases}
    per: dict[str, Any] = {}
    for name, perturb in PERTURBATIONS.items():
        changed = []
        for c in cases:
            before = base[c["id"]]
            after = verdict(c, perturb([(e["kind"], e["text"]) for e in c["evidence"]]))
            # a wrap or prefix may add what the logs say of the victim (srun's task id is a
            # rank), never take it away or change it
            if after[:2] != before[:2] or (before[2] is not None and after[2] != before[2]):
                truth = c["ground_truth"]
                changed.append(
                    {
                        "id": c["id"],
                        "half": half(c["source"]),
                        "truth": truth,
                        "before": list(before),
                        "after": list(after),
                        "became_confident_wrong": after[0] != truth
                        and after[1] in CONFIDENT
                        and not (before[0] != truth and before[1] in CONFIDENT),
                        "became_right": after[0] == truth and before[0] != truth,
                        "became_wrong": after[0] != truth and before[0] == truth,
                    }
                )
        per[name] = {
            "cases": len(cases),
            "changed": len(changed),
            "became_wrong": sum(r["became_wrong"] for r in changed),
            "became_right": sum(r["became_right"] for r in changed),
            "became_confident_wrong": sum(r["became_confident_wrong"] for r in changed),
            "rows": changed,
        }
        print(
            f"{name:<13} changed {len(changed):>3}/{len(cases)}; wrong {per[name]['became_wrong']}, "
            f"right {per[name]['became_right']}, confident-wrong {per[name]['became_confident_wrong']}"
        )
        for r in changed:
            print(f"    {r['half']:<8} {r['id']:<48} {tuple(r['before'])} -> {tuple(r['after'])}")
    results.write(
        args.name,
        {
            "cases_files": [str(f.resolve().relative_to(results.REPO)) for f in files],
            "perturbations": list(PERTURBATIONS),
            "changed_total": sum(p["changed"] for p in per.values()),
            "confident_wrong_total": sum(p["became_confident_wrong"] for p in per.values()),
            "seconds": round(time.perf_counter() - started, 1),
            "per_perturbation": per,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
