"""Postmortem documents made by hand, for the store and the routes that list it."""

from __future__ import annotations


def stored_doc(ident: str) -> dict:
    """The least postmortem the store keeps and lists: its schema, id, time, victim and killer."""
    return {
        "schema": "trainwatch.postmortem/v1",
        "id": ident,
        "created_at": "2026-12-02T11:40:16.000+00:00",
        "victim": {"rank": 1},
        "killer": {"kind": "cgroup_oom", "summary": "s"},
    }
