"""``python -m sidecar.dashboard > dashboards/trainwatch.json``."""

from sidecar.dashboard import main

main()
