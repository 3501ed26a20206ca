# The two commands of the README:
#   make demo   set up, then run the demo (a real torchrun job dies; its postmortem is printed)
#   make test   set up, then lint, type-check and run every test
# and `make run`: set up, then run the daemon (trainwatch --attach-torchrun).
.PHONY: setup demo run test lint bench bench-gpu readme dashboard fuzz

setup:
	@scripts/dev-setup

demo: setup
	.venv/bin/trainwatch demo

run: setup
	.venv/bin/trainwatch --attach-torchrun $(ARGS)

lint:
	.venv/bin/ruff check sidecar tests benchmarks
	.venv/bin/ruff format --check sidecar tests benchmarks
	.venv/bin/mypy

test: setup lint
	@scripts/test-prep
	.venv/bin/python -m pytest -q -ra $(PYTEST_ARGS)

# Every figure in the README comes from benchmarks/results/*.json: `make bench` writes them
# (about 45 minutes on 2 cores; as root for the real cgroup and global OOMs) and renders the README.
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

readme:
	.venv/bin/python benchmarks/render.py

# Every parser and input the daemon reads, on many random inputs (tests/fuzz.py); CI runs
# the same targets on a small budget. EXAMPLES per target (default 5000).
fuzz: setup
	.venv/bin/python scripts/fuzz --examples $${EXAMPLES:-5000}

dashboard: setup
	.venv/bin/python -m sidecar.dashboard > dashboards/trainwatch.json
