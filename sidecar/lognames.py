"""The daemon's logger names: a contract (an operator filters the journal by them, the docs
show them), so each is said once here and every module of its room logs under it. A room
split into modules keeps one name; a name never changes with a move.

| name | what logs under it |
| --- | --- |
| ``trainwatch`` | the front: the service starting and stopping, ``trainwatch run`` |
| ``sidecar.daemon`` | the schedule and the sampler's problems (a probe that fails, once) |
| ``sidecar.discovery`` | agents and ranks found, jobs attached |
| ``sidecar.foresight`` | the WARNING that a rank's memory will reach its limit |
| ``sidecar.stalls`` | a job's stall, its suspects, the stacks taken |
| ``sidecar.stranded`` | survivors a death left without progress |
| ``sidecar.deaths`` | the death watch: incidents, autopsies, postmortems written |
| ``sidecar.journal`` | the saved state: written, restored, refused |
"""

from __future__ import annotations

__all__ = ["DAEMON", "DEATHS", "DISCOVERY", "FORESIGHT", "FRONT", "JOURNAL", "STALLS", "STRANDED"]

FRONT = "trainwatch"
DAEMON = "sidecar.daemon"
DISCOVERY = "sidecar.discovery"
FORESIGHT = "sidecar.foresight"
STALLS = "sidecar.stalls"
STRANDED = "sidecar.stranded"
DEATHS = "sidecar.deaths"
JOURNAL = "sidecar.journal"
