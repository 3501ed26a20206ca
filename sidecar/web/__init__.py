"""The web: the HTTP endpoint and what keeps it safe.

- ``server``: the routes (``/metrics``, ``/postmortem``, ``/ranks``, ``/story``, health),
  each handed what it serves.
- ``config``: the exporter-toolkit's web configuration (TLS, basic auth, headers), read and
  checked at start; ``guard`` enforces it on every request and reloads it.
"""
