"""How an answer of `trainwatch diagnose` to a case of the public corpus is scored: by the
tests (tests/unit/diagnose/test_diagnose.py, tests/unit/parse/test_pasted.py) and the
benchmarks (benchmarks/diagnose_accuracy.py, benchmarks/paste_robustness.py) alike."""

from __future__ import annotations

from typing import Any

from sidecar.diagnose import LogInput, diagnose

CONFIDENT = ("certain", "likely")  # the confidences an answer must never be wrong with


def score(case: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(the kind the tool answered for the case's rank, its confidence, the document). A
    case about a rank the agent tore down is answered by that rank's fate."""
    doc = diagnose([LogInput(f"{e['kind']}-{i}", e["text"]) for i, e in enumerate(case["evidence"])])
    kind = doc["killer"]["kind"]
    confidence = doc["killer"]["confidence"]
    rank = case.get("failed_rank")
    if rank is not None:
        row = next((r for r in doc["ranks"] if rank in (r["rank"], r["local_rank"])), None)
        if row is not None and row["fate"] == "terminated_by_agent":
            kind, confidence = "agent_teardown", "certain"  # the agent's own log says it sent the signal
    return kind, confidence, doc
