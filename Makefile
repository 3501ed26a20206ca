# The two commands of the README:
#   make demo   set up, then run the demo (a real torchrun job dies; its postmortem is printed)
#   make test   set up, then lint, type-check and run every test, in the steps CI runs
# The quick loop: `make check` (lint, types and the fast tests, side by side; under a minute
# once set up). `make run`: set up, then run the daemon (trainwatch --attach-torchrun).
# Setting up installs again only what changed (scripts/dev-setup).
.PHONY: setup demo run test check lint wheel-smoke bench bench-gpu docs dashboard fuzz

LINT_PATHS = sidecar tests benchmarks setup.py scripts/wheel-smoke

setup:
	@scripts/dev-setup

demo: setup
	.venv/bin/trainwatch demo

run: setup
	.venv/bin/trainwatch --attach-torchrun $(ARGS)

check: setup
	@scripts/check $(PYTEST_ARGS)

lint:
	.venv/bin/ruff check $(LINT_PATHS)
	.venv/bin/ruff format --check $(LINT_PATHS)
	.venv/bin/mypy

# Every test, in CI's steps (scripts/test-steps): lint and types beside the fast tests in
# parallel; the end-to-end tests side by side; the wheel's smoke test; the tests that drive
# the whole machine (a real global OOM) alone, last. Each step says how long it took, and
# the slowest tests are listed.
test: setup
	@scripts/test-prep
	@scripts/test-steps $(PYTEST_ARGS)

# The wheel, built and installed as the container image does, smoke-tested in a clean
# environment per declared Python (part of `make test`).
wheel-smoke: setup
	.venv/bin/python scripts/wheel-smoke

# Every figure in docs/ comes from benchmarks/results/*.json: `make bench` writes them
# (about 45 minutes on 2 cores; as root for the real cgroup and global OOMs) and renders them.
bench: setup
	.venv/bin/python benchmarks/diagnose_accuracy.py
	.venv/bin/python benchmarks/deaths.py
	.venv/bin/python benchmarks/loaded_deaths.py
	.venv/bin/python benchmarks/foresight.py
	.venv/bin/python benchmarks/pss_cost.py
	.venv/bin/python benchmarks/overhead.py $(ARGS)
	.venv/bin/python benchmarks/render.py

# On a machine with an NVIDIA GPU, torch and the runtime dependencies (no .venv needed):
# GPU memory per rank against torch and nvidia-smi, and a real training loop's step time.
bench-gpu:
	bash benchmarks/gpu_check.sh $${OUT:-/tmp/trainwatch-gpu-check}
	python3 benchmarks/step_overhead.py --steps 5000 --phase 2
	python3 benchmarks/render.py

# The generated pages: the figures (benchmarks/render.py), the options and the metrics
# (from the code's own tables), the dashboard. The tests check each is current.
docs: setup
	.venv/bin/python benchmarks/render.py
	.venv/bin/python -m sidecar.front.manual --options > docs/options.md
	.venv/bin/python -m sidecar.metrics.table > docs/metrics.md
	.venv/bin/python -m sidecar.dashboard > dashboards/trainwatch.json

# Every parser and input the daemon reads, on many random inputs (tests/support/fuzz.py); CI runs
# the same targets on a small budget. EXAMPLES per target (default 5000).
fuzz: setup
	.venv/bin/python scripts/fuzz --examples $${EXAMPLES:-5000}

dashboard: setup
	.venv/bin/python -m sidecar.dashboard > dashboards/trainwatch.json
