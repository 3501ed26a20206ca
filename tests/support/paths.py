"""Where the tests' fixtures live: all inside the repository, so a clone with nothing beside
it runs every test (tests/fixtures/*/README.md give each fixture's provenance)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/support/paths.py
FIXTURES = REPO / "tests" / "fixtures"
PUBLIC_CASES = FIXTURES / "public-logs" / "cases.jsonl"
CAPTURES = FIXTURES / "device-captures"
FR_DUMP = CAPTURES / "fr-dump-nccl-timeout-rank0.pickle"
DEVICE_H200 = FIXTURES / "device-h200"  # a real NCCL timeout and CUDA OOM under trainwatch run
DEVICE_H100 = FIXTURES / "device-h100"  # survivors of a real NCCL job after a rank's death
RANK_OUTPUT = FIXTURES / "rank-output"
