# The two commands of the README:
#   make demo   set up, then run the demo (a real torchrun job dies; its postmortem is printed)
#   make test   set up, then lint, type-check and run every test
# and `make run`: set up, then run the daemon (trainwatch --attach-torchrun).
.PHONY: setup demo run test lint bench dashboard

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
	.venv/bin/python -m pytest -q -ra $(PYTEST_ARGS)

bench: setup
	.venv/bin/python benchmarks/overhead.py $(ARGS)
	.venv/bin/python benchmarks/accuracy.py
	.venv/bin/python benchmarks/deaths.py
	.venv/bin/python benchmarks/diagnose_accuracy.py

dashboard: setup
	.venv/bin/python -m sidecar.dashboard > dashboards/trainwatch.json
