"""Prometheus exposition: a custom Collector on a private registry that builds every
metric family fresh from the latest Snapshot on each scrape. A scrape does no I/O, so
series of a rank that is gone simply are not produced: nothing stale is left behind.

One job a module: ``table`` the names, types and help texts (``METRICS``; CONTRACTS.md
fixes the minimum set), ``collector`` the families built from a snapshot and the death
counters, ``families`` how they are written (prometheus_client's objects, or the
exposition's text straight, with the per-scrape clock).
"""
