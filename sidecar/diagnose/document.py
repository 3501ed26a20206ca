"""The postmortem document from the logs (``trainwatch diagnose``): the verdict's ranks,
evidence and advice through the same document builder as the daemon's, with what the logs
cannot fill left null and what to collect next time."""

from __future__ import annotations

import socket
import time
from typing import Any

from sidecar.autopsy.advice import RankMemory, advice
from sidecar.autopsy.logs import COLLECT_DAEMON
from sidecar.diagnose.contents import gather
from sidecar.diagnose.inputs import LogInput
from sidecar.diagnose.ranks import when
from sidecar.diagnose.verdict import decide
from sidecar.model import Fate
from sidecar.postmortem.document import Cited, HostAtDeath, JobInfo, Parts, RankRow, Victim, build, make_id

__all__ = ["diagnose"]


def _sentence(text: str) -> str:
    """A summary that starts with a rank named by its pid alone starts a sentence."""
    return "T" + text[1:] if text.startswith("the process") else text


def diagnose(inputs: list[LogInput], now: float | None = None) -> dict[str, Any]:
    """The postmortem document (trainwatch.postmortem/v1) the logs support; fields they
    cannot fill are null. ``inputs``, ``collect`` and ``diagnosed_by`` are extra fields."""
    now = time.time() if now is None else now
    g = gather(inputs, now)
    out = decide(g, now)
    v = out.verdict
    by_label = {r.label: r for r in out.ranks}
    kernel_at = {line.text: line.at for line in g.kernel if line.at is not None}
    out.ranks.sort(key=lambda r: (r.rank is None and r.local_rank is None, r.rank or 0, r.local_rank or 0))
    rows = [
        RankRow(
            rank=r.rank,
            local_rank=r.local_rank,
            pid=r.pid,
            exit_code=r.returncode,
            signal=-r.returncode if r.returncode is not None and r.returncode < 0 else None,
            died_at=r.at,
            fate=v.fates.get(r.label, Fate.UNKNOWN) if v else Fate.UNKNOWN,
            rss_bytes=out.kernel.task_rss_bytes(r.pid),
            local_rank_inferred=r.inferred_local,
        )
        for r in out.ranks
    ]
    host_total = out.kernel.host_total
    vr = by_label.get(v.victim.label) if v else None
    cited: list[Cited] = []
    tips: list[str] = []
    if v is not None:
        if vr is not None and vr.lines:
            cited.append(
                Cited(source=_said_by(vr.lines[0]), at=when(vr.lines[0], g.dating), detail=vr.lines[0])
            )
        cited += [
            Cited(source=e.source, at=kernel_at.get(e.detail), detail=e.detail)
            for e in (*v.evidence[1:], *out.notes)  # the first item is the synthetic exit line
        ]
        # what only the daemon could change is left out: "collect" says what logs need
        memory = [RankMemory(r.rss_bytes, r.tree_rss_bytes) for r in rows]
        tips = advice(v, memory, host_total=host_total, live=False)
    collect = list(dict.fromkeys([*out.collect, *([COLLECT_DAEMON] if out.collect else [])]))
    died = vr.at if vr is not None else None
    ident = make_id(died or now, 0, (v.victim.label if v else "x").replace("?", "x"), g.host or "logs")
    return build(
        Parts(
            ident=ident,
            created_at=now,
            updated_at=None,
            host=g.host,
            job=JobInfo(),
            verdict=v,
            summary=_sentence(v.summary) if v else None,
            victim=Victim(exit_code=vr.returncode if vr else None, died_at=died),
            evidence=cited,
            ranks=rows,
            host_memory=HostAtDeath(total_bytes=host_total),
            cgroup=None,
            timeline=[],
            stall=None,
            advice=tips,
            extra={
                "collect": collect,
                "inputs": [{"name": name, "kinds": kinds} for name, kinds in g.kinds.items()],
                "diagnosed_by": f"trainwatch diagnose on {socket.gethostname()}",
            },
        )
    )


_TORCHRUN_WORDS = ("torch.distributed", "torch/distributed", "exitcode", "closing signal")


def _said_by(line: str) -> str:
    """Whose line names the victim's end: the torch elastic agent's (its failure table and
    its own log), else another launcher's or a scheduler's (srun, DeepSpeed, Composer, a
    shell), so that a Slurm line is not cited as torchrun's."""
    return "torchrun" if any(w in line for w in _TORCHRUN_WORDS) else "launcher"
