"""What the inputs of ``trainwatch diagnose`` hold: every parser on all of every input, so a
file's kind comes from what it holds, not its name, and a file that mixes the agent's
lines, the ranks' tracebacks and a pasted ``dmesg`` is read for all three. Into one
``LogRecords``, with the kinds each input was found to hold."""

from __future__ import annotations

import re

from sidecar.autopsy import UserspaceKill
from sidecar.autopsy.logrecords import LogRecords
from sidecar.catalog import Hit, catalog
from sidecar.diagnose.inputs import MAX_BYTES, LogInput
from sidecar.diagnose.ranks import exit_of
from sidecar.parse.jobs import parse_job_lines
from sidecar.parse.logs import dating_of, kernel_lines, line_time
from sidecar.parse.oomd import parse_userspace_oom_line
from sidecar.parse.pasted import plain_all
from sidecar.parse.ranks import parse_rank_output
from sidecar.parse.torchrun import parse_agent_text

__all__ = ["gather"]

_HOST = re.compile(r"^\s*host\s*:\s*(\S+)", re.M)


_GENERATION = (
    (re.compile(r"^(?:WARNING|ERROR|INFO):torch\.distributed", re.M), "torch 1.9-2.0"),
    (re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] torch\.distributed\.elastic", re.M), "torch 2.1-2.3"),
    (re.compile(r"^[IWEF]\d{4} [\d:.]+ \d+ \S*torch/distributed/", re.M), "torch 2.4+"),
)


def gather(inputs: list[LogInput], now: float | None = None) -> LogRecords:
    g = LogRecords({}, [], [], [], [], [], False)
    texts = plain_all([inp.text for inp in inputs])
    # year-less stamps (syslog's, glog's) are dated from the paste's own dated lines, else
    # the files' times, never after now
    g.dating = dating_of(texts, [inp.mtime for inp in inputs if inp.mtime is not None], now)
    for index, (inp, text) in enumerate(zip(inputs, texts, strict=True)):
        kinds: list[str] = []
        agent = parse_agent_text(text)
        if agent:
            gen = next((name for rx, name in _GENERATION if rx.search(text)), None)
            kinds.append("torchrun agent" + (f" ({gen})" if gen else ""))
            g.agent += agent
            host = _HOST.search(text)
            if host and g.host is None:
                g.host = host[1]
        found = parse_rank_output(text)
        if found:
            kinds.append("rank output")
            g.output_read = True
        g.findings += [(None, f) for f in found]
        g.finding_inputs += [index] * len(found)
        klines = kernel_lines(text, g.dating)
        if klines:
            styles = sorted({k.style for k in klines if k.style != "bare"})
            kinds.append("kernel log" + (f" ({', '.join(styles)})" if styles else ""))
            g.kernel += klines
            if g.host is None:
                g.host = next((k.host for k in klines if k.host), None)
        sources: set[str] = set()
        others = catalog().part("agent", "kernel", "shell", "scheduler")
        lines = text.splitlines()
        scanned = others.scan_lines(lines)
        vetoed = _vetoed(scanned)
        for n, (line, hits) in enumerate(zip(lines, scanned, strict=True)):
            for hit in hits:
                if hit.message.decides:
                    g.said.append((hit, line_time(line, g.dating)))
                elif hit.message.relays_death:
                    g.relayed.append(line)
                elif hit.message.channel != "kernel" and exit_of(hit) is not None:
                    if (n, hit.message.id) in vetoed:
                        continue  # a status no process ended with (the kubelet's own 137)
                    g.exits.append((hit, line_time(line, g.dating)))
                else:
                    continue
                # an emitter the agent's or the kernel's lines already name is said once, unless
                # its words are all there is (an agent's exception alone)
                if hit.message.emitter not in _NAMED_ALREADY or not (klines or agent):
                    sources.add(hit.message.emitter)
            for rec in parse_job_lines(line):
                if rec.what == "exit_code" and any(at == n for at, _ in vetoed):
                    continue  # the same status, read by the job-line reader
                g.jobs.append(rec)
                sources.add(rec.source)
            if "oom" in line.lower() or "earlyoom" in line:
                u = parse_userspace_oom_line(line)
                if u is not None:
                    g.userspace.append(
                        UserspaceKill(u.daemon, u.pid, u.cgroup, u.signal, None, u.text, "log")
                    )
                    g.userspace_at.append(line_time(line, g.dating))
                    sources.add(u.daemon)
        kinds += sorted(sources)
        if inp.truncated:
            kinds.append(f"(its last {MAX_BYTES >> 20} MiB read)")
        g.kinds[inp.name] = kinds or ["nothing recognised"]
    return g


VETO_LINES = 4  # a vetoing message and the status it vetoes are in one record, this close


def _vetoed(found: list[list[Hit]]) -> set[tuple[int, str]]:
    """(line, message id) of every exit report that a message beside it vetoes (the
    catalog's ``vetoes``: ContainerStatusUnknown's synthesised ``Exit Code: 137``)."""
    out: set[tuple[int, str]] = set()
    for n, hits in enumerate(found):
        for hit in hits:
            if not hit.message.vetoes:
                continue
            for other in range(max(0, n - VETO_LINES), min(len(found), n + VETO_LINES + 1)):
                out |= {(other, h.message.id) for h in found[other] if h.message.id in hit.message.vetoes}
    return out


# emitters whose texts the structured readers above already name as a kind of input
_NAMED_ALREADY = frozenset({"linux", "nvrm", "torchelastic"})
