"""``python -m sidecar`` is the same as the ``trainwatch`` console script."""

from sidecar.front.cli import main

raise SystemExit(main())
