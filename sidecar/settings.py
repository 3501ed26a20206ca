"""The daemon's settings: what ``options.parse_args`` produces and everything else consumes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_HISTORY_SECONDS",
    "DEFAULT_INTERVAL_SECONDS",
    "DEFAULT_PORT",
    "EVIDENCE_SOURCES",
    "PRESSURE_INTERVAL_SECONDS",
    "Settings",
    "default_postmortem_dir",
]

DEFAULT_INTERVAL_SECONDS = 1.0
DEFAULT_PORT = 9864
DEFAULT_HISTORY_SECONDS = 600.0
# The sampler's interval while a rank is near a memory limit (the run-up to an OOM kill).
PRESSURE_INTERVAL_SECONDS = 0.1

# What --disable can turn off: where exits and evidence come from (doctor says which work).
EVIDENCE_SOURCES = {
    "connector": "the netlink process connector (exit statuses from the kernel)",
    "pidfd": "pidfds on the ranks (exit statuses where the connector is refused)",
    "kmsg": "the kernel log /dev/kmsg (OOM records)",
    "tracepoint": "the signal:signal_generate tracepoint (who sent a signal)",
    "outputs": "reading the agent's, ranks' and OOM daemons' stdout/stderr files (exit codes, the ranks' "
    "last words, kill lines)",
    "nvml": "NVML (GPU memory per device and per rank, lost GPUs); off on a machine without NVIDIA GPUs",
    "smaps": "/proc/PID/smaps_rollup (PSS and USS of each rank's tree and its workers; the kernel walks "
    "the process's mappings under its mmap lock)",
}


def default_postmortem_dir() -> str:
    """``/var/lib/trainwatch/postmortems`` for root, else under ``$XDG_STATE_HOME``."""
    if os.geteuid() == 0:
        return "/var/lib/trainwatch/postmortems"
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "trainwatch", "postmortems")


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    attach_torchrun: bool = True
    pids: tuple[int, ...] = ()
    interval_seconds: float = DEFAULT_INTERVAL_SECONDS
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    postmortem_dir: str = field(default_factory=default_postmortem_dir)
    history_seconds: float = DEFAULT_HISTORY_SECONDS
    log_level: str = "INFO"
    proc_root: str = "/proc"
    shm_path: str = "/dev/shm"
    disabled: frozenset[str] = frozenset()
    stall_after_seconds: float = 60.0  # a job whose ranks all idle this long is "stalled"
    # run: end the job once ranks have been stranded this long (stalls/stranded.py); None: never
    end_stranded_after_seconds: float | None = None
    # run (no option): its TRAINWATCH_RUN_OUTPUT, by which its own Slurm step's tasks are known
    run_marker: str | None = None
    # py-spy stacks in the stall snapshot: True required, False off, None where installed and permitted
    py_spy: bool | None = None
    oom_score_adj: int | None = -1000  # set at start; None leaves it as inherited
    self_protection: bool = True  # lock memory, raise the death path's priority
    web_config: str | None = None  # exporter-toolkit web config: TLS and basic auth
    prometheus: str | None = None  # the Prometheus scraping every node: GET /story
    peer_config: str | None = None  # credentials for the other nodes' daemons (story)
    connector_buffer_bytes: int = 8 << 20  # the process connector socket's receive buffer

    @property
    def sampler_stall_seconds(self) -> float:
        """How long without a finished sample before /healthz says the sampler stalled."""
        return max(5.0 * self.interval_seconds, 5.0)
