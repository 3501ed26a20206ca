"""``python -m sidecar`` is the same as the ``trainwatch`` console script."""

from sidecar.cli import main

raise SystemExit(main())
