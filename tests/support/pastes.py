"""What people do to logs before they paste them, applied to a log's text: the perturbations
the paste benchmark (benchmarks/paste_robustness.py) and the paste tests score verdicts
under. Each takes the evidence of one case (a list of (kind, text)) and returns new evidence;
none changes what a line says, only how it is carried.

Prefix families, each on every line (the timestamps and hosts are made up, the shapes are
the tools'):

* ``line_numbers``: ``[1787] `` (a log viewer's or a paste site's line numbers);
* ``srun``: ``srun -l``'s task id: the rank the line names, else 0 (under torchrun: 0, the node);
* ``mpirun``: Open MPI's ``--tag-output`` (``[1,3]<stderr>:``), its rank chosen as srun's;
* ``cri``: a container runtime's log file (``2026-12-02T11:53:34.123456789Z stderr F ``);
* ``docker``: ``docker logs --timestamps`` (``2026-12-02T11:53:34.123456789Z ``);
* ``kubectl``: ``kubectl logs --prefix`` (``[pod/train-0/pytorch] ``);
  (these four on what a process printed: the agent's and the ranks' output, not a kernel
  log, a scheduler's records or ``kubectl describe``)
* ``journald``: ``journalctl``'s short format (``Dec 02 11:53:34 node-1 python3[4242]: ``,
  the kernel's lines as ``node-1 kernel: ``);
* ``ansi``: each line coloured (a terminal's escape sequences kept by a copy);
* ``crlf``: Windows line ends.

Wraps, at 80 and 120 columns: ``wrap80``/``wrap120`` as a terminal does (every piece but the
last exactly that wide, mid-word), ``web80``/``web120`` as a web page does (at the last space
before the width, the space dropped).

Layout: ``one_file`` (every input concatenated) and ``per_rank`` (each input split into one
file per rank its ``[rankN]:`` lines name, the rest in a file of its own).
"""

from __future__ import annotations

import re
from collections.abc import Callable

Evidence = list[tuple[str, str]]

_RANK = re.compile(r"^\s{0,4}\[(?:rank|default)(\d{1,6})\]:")
_SAYS_RANK = re.compile(r"^\s{0,4}\[(?:rank|default)(\d{1,6})\]:|\[Rank (\d{1,6})\]")


# what a process prints (a tool that carries a process's output prefixes these; a kernel log,
# a scheduler's accounting or `kubectl describe` is never carried that way)
OUTPUT_KINDS = frozenset({"torchrun_log", "rank_stderr", "other"})


def _each_line(
    fn: Callable[[int, str], str], kinds: frozenset[str] | None = None
) -> Callable[[Evidence], Evidence]:
    def apply(evidence: Evidence) -> Evidence:
        return [
            (kind, "\n".join(fn(i, line) for i, line in enumerate(text.split("\n"))))
            if kinds is None or kind in kinds
            else (kind, text)
            for kind, text in evidence
        ]

    return apply


def _journald(evidence: Evidence) -> Evidence:
    """journalctl's short format: the kernel's lines as ``kernel:``, a process's as its unit."""
    out: Evidence = []
    for kind, text in evidence:
        who = "kernel" if kind == "kernel_log" else "python3[4242]"
        lines = text.split("\n")
        out.append(
            (
                kind,
                "\n".join(f"Dec 02 11:53:{i % 60:02d} node-1 {who}: {line}" for i, line in enumerate(lines)),
            )
        )
    return out


_AGENT = re.compile(
    r"torch\.distributed\.elastic|torch/distributed/elastic|\btorchrun\b|torch\.distributed\.run"
)


def _launched(tag: Callable[[str], str]) -> Callable[[Evidence], Evidence]:
    """A launcher's per-process tag (``tag(rank)``) as it prints it: under torchrun (the
    case's logs hold the elastic agent's lines) it started one agent on this node, process 0;
    started alone, each process is a rank: the rank a line names (torch's ``[rankN]:``),
    else the rank the lines before it named (the first one named, before any)."""

    def apply(evidence: Evidence) -> Evidence:
        nodes = any(_AGENT.search(text) for _, text in evidence)

        def tasks(text: str) -> str:
            lines = text.split("\n")
            if nodes:
                return "\n".join(tag("0") + line for line in lines)
            said = [(m[1] or m[2]) if (m := _SAYS_RANK.search(line)) else None for line in lines]
            current = next((r for r in said if r is not None), "0")
            out = []
            for line, rank in zip(lines, said, strict=True):
                current = rank or current
                out.append(tag(current) + line)
            return "\n".join(out)

        return [(kind, tasks(text)) if kind in OUTPUT_KINDS else (kind, text) for kind, text in evidence]

    return apply


def _terminal(width: int) -> Callable[[Evidence], Evidence]:
    def cut(text: str) -> str:
        out = []
        for line in text.split("\n"):
            if len(line) <= width:
                out.append(line)
                continue
            out += [line[k : k + width] for k in range(0, len(line), width)]
        return "\n".join(out)

    return lambda evidence: [(kind, cut(text)) for kind, text in evidence]


def _web(width: int) -> Callable[[Evidence], Evidence]:
    def cut(text: str) -> str:
        out = []
        for line in text.split("\n"):
            while len(line) > width:
                at = line.rfind(" ", 1, width + 1)
                if at <= 0:  # one word longer than the width: the page breaks it anywhere
                    out.append(line[:width])
                    line = line[width:]
                else:
                    out.append(line[:at])
                    line = line[at + 1 :]
            out.append(line)
        return "\n".join(out)

    return lambda evidence: [(kind, cut(text)) for kind, text in evidence]


def _one_file(evidence: Evidence) -> Evidence:
    return [("rank_stderr", "\n".join(text for _, text in evidence))]


def _per_rank(evidence: Evidence) -> Evidence:
    out: Evidence = []
    for kind, text in evidence:
        files: dict[str, list[str]] = {}
        for line in text.split("\n"):
            m = _RANK.match(line)
            files.setdefault(m[1] if m else "", []).append(line)
        out += [(kind, "\n".join(lines)) for _, lines in sorted(files.items())]
    return out


PERTURBATIONS: dict[str, Callable[[Evidence], Evidence]] = {
    "line_numbers": _each_line(lambda i, line: f"[{i + 1}] {line}"),
    "srun": _launched(lambda rank: f"{rank}: "),
    "mpirun": _launched(lambda rank: f"[1,{rank}]<stderr>:"),
    "cri": _each_line(
        lambda i, line: f"2026-12-02T11:53:{i % 60:02d}.123456789Z stderr F {line}", OUTPUT_KINDS
    ),
    "docker": _each_line(lambda i, line: f"2026-12-02T11:53:{i % 60:02d}.123456789Z {line}", OUTPUT_KINDS),
    "kubectl": _each_line(lambda i, line: f"[pod/train-0/pytorch] {line}", OUTPUT_KINDS),
    "journald": _journald,
    "ansi": _each_line(lambda i, line: f"\x1b[31m{line}\x1b[0m" if line else line),
    "crlf": lambda evidence: [(kind, text.replace("\n", "\r\n")) for kind, text in evidence],
    "wrap80": _terminal(80),
    "wrap120": _terminal(120),
    "web80": _web(80),
    "web120": _web(120),
    "one_file": _one_file,
    "per_rank": _per_rank,
}
