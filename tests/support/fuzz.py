"""Structured fuzzing of every parser and every input the daemon reads from a job or the
kernel: kmsg records, kernel log lines, torchrun agent logs, rank output, error files,
flight-recorder pickles, OOM-daemon and job-manager lines, /proc and cgroup files,
``diagnose`` inputs, the redactor.

Inputs are real text from ``tests/fixtures`` mutated by Hypothesis (spans inserted, cut,
doubled or swapped between fixtures, numbers made huge or negative, bytes flipped, lines
glued), plus arbitrary text and bytes. A target passes when every input returns or raises
one of the exceptions its contract names (``ParseError``, ``ValueError``); anything else is
a crasher. ``tests/unit/test_fuzz.py`` runs each target on a small budget in CI;
``scripts/fuzz`` (``make fuzz``) on a large one, and also times each call: no input may
take more than ~10 ms per KiB.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.paths import CAPTURES, FIXTURES, PUBLIC_CASES

REGRESSIONS = FIXTURES / "fuzz-regressions"


@lru_cache(maxsize=1)
def corpus() -> dict[str, list[str]]:
    """Real text by kind, from the repository's fixtures."""
    out: dict[str, list[str]] = {"kernel": [], "agent": [], "rank": [], "jobs": [], "any": []}
    for line in PUBLIC_CASES.read_text().splitlines():
        case = json.loads(line)
        for e in case["evidence"]:
            kind = {"kernel_log": "kernel", "torchrun_log": "agent", "rank_stderr": "rank"}.get(
                e["kind"], "jobs"
            )
            out[kind].append(e["text"])
    for p in CAPTURES.glob("torchrun-*.json"):
        doc = json.loads(p.read_text())
        out["agent"].append("\n".join(line.split(" ", 1)[-1] for line in doc.get("agent_output", [])))
    for p in (FIXTURES / "rank-output").iterdir():
        out["rank"].append(p.read_text(errors="replace"))
    for p in (FIXTURES / "device-h200").glob("*.std*"):
        out["rank"].append(p.read_text(errors="replace"))
    for p in (FIXTURES / "diagnose" / "opening-story").iterdir():
        out["kernel" if "dmesg" in p.name else "agent"].append(p.read_text())
    for texts in list(out.values()):
        out["any"].extend(texts)
    return {k: [t for t in v if t] for k, v in out.items()}


@lru_cache(maxsize=1)
def proc_files() -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for p in (FIXTURES / "proc-torchrun").rglob("*"):
        if p.is_file():
            out.setdefault(p.name, []).append(p.read_bytes())
    return out


NUMBERS = ["0", "-1", "18446744073709551615", "9" * 40, "1e308", "nan", "-0", "0x7f", "１２", ""]


def _mutate(text: str, ops: list[tuple[int, int, int, str]], other: str) -> str:
    for kind, a, b, piece in ops:
        n = len(text)
        i, j = (a % (n + 1), b % (n + 1)) if n else (0, 0)
        i, j = min(i, j), max(i, j)
        if kind == 0:
            text = text[:i] + piece + text[i:]
        elif kind == 1:
            text = text[:i] + text[j:]
        elif kind == 2:
            text = text[:j] + text[i:j] * (1 + b % 50) + text[j:]
        elif kind == 3:
            k = a % (len(other) + 1)
            text = text[:i] + other[k : k + 1 + b % 400] + text[j:]
        elif kind == 4:
            text = re.sub(r"\d+", NUMBERS[a % len(NUMBERS)], text, count=1 + b % 3)
        elif kind == 5:
            text = text.replace("\n", piece or " ", 1 + a % 5)
        elif kind == 6:
            text = text[:i]
    return text


def mutated(kind: str) -> st.SearchStrategy[str]:
    """Real text of ``kind``, mutated; sometimes cut down to one line of it."""
    texts = corpus()[kind]
    ops = st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.text(max_size=40)),
        max_size=6,
    )
    whole = st.builds(_mutate, st.sampled_from(texts), ops, st.sampled_from(corpus()["any"]))
    one_line = st.builds(
        lambda t, k, o: _mutate((t.splitlines() or [""])[k % max(1, len(t.splitlines()))], o, t),
        st.sampled_from(texts),
        st.integers(0, 1 << 16),
        ops,
    )
    return st.one_of(whole, one_line, one_line, st.text(max_size=2000))


def mutated_bytes(name: str) -> st.SearchStrategy[bytes]:
    files = proc_files().get(name) or [b""]
    flips = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=8)

    def flip(data: bytes, changes: list[tuple[int, int]], cut: int) -> bytes:
        b = bytearray(data)
        for pos, val in changes:
            if b:
                b[pos % len(b)] = val
        return bytes(b[: cut % (len(b) + 1)]) if cut % 3 == 0 else bytes(b)

    texts = st.builds(lambda t: t.encode(), mutated("any"))
    return st.one_of(
        st.builds(flip, st.sampled_from(files), flips, st.integers(0, 1 << 16)),
        st.binary(max_size=4000),
        texts,
    )


def dump_payloads() -> st.SearchStrategy[bytes]:
    """Flight-recorder dumps: the real one with its structure bent, JSON variants, garbage,
    and pickles that name classes (must be refused, never run)."""
    from sidecar.parse.flight import _PlainData

    real = _PlainData(io.BytesIO((CAPTURES / "fr-dump-nccl-timeout-rank0.pickle").read_bytes())).load()
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20))
    values = st.recursive(
        leaf,
        lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
        max_leaves=20,
    )

    def bend(key_path: list[str], value: Any) -> bytes:
        doc = json.loads(json.dumps(real, default=str))
        node = doc
        for k in key_path[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                break
        if isinstance(node, dict) and key_path:
            node[key_path[-1]] = value
        return pickle.dumps(doc)

    names = [
        "entries",
        "pg_status",
        "pg_config",
        "version",
        "0",
        "default_pg",
        "last_enqueued_collective",
        "desc",
    ]
    keys = st.lists(st.sampled_from(names), min_size=1, max_size=3)
    as_json = st.builds(lambda v: json.dumps({"entries": v, "pg_status": v}).encode(), values)
    return st.one_of(
        st.builds(bend, keys, values), as_json, st.binary(max_size=2000), st.builds(pickle.dumps, values)
    )


@dataclass
class Target:
    name: str
    call: Callable[[Any], Any]
    inputs: st.SearchStrategy[Any]
    allowed: tuple[type[BaseException], ...] = ()


def _json_values() -> st.SearchStrategy[Any]:
    """Any JSON value, nested."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
        ),
        max_leaves=40,
    )


def _a_state() -> Any:
    """A real journal state: one job's rank, its cgroup and an incident."""
    from sidecar.deaths.incidents import Generation, Known
    from sidecar.deaths.saved import SavedIncident, SavedState
    from sidecar.model import CgroupLevel, CgroupSample, MemoryCharge, ProcKey, RankSample, TimelinePoint

    gen = Generation("j", 9, "run", 2, 0, "t.py")
    rank = RankSample("j", 1, "1", 1, 0, ProcKey(10, 5), 100, 120, 1.5, 4, 200, 2, "/job", {0: 7}, (10,),
                      (0, "/tmp/nccl_trace_rank_"), "/tmp/e.json", 1000)  # fmt: skip
    cg = CgroupSample("/job", 1, 900, 1000, 950, 0, None, (CgroupLevel("/", None),), "/job", 1000,
                      MemoryCharge(600, 100, 150, 10, 800, 100), {"max": 1})  # fmt: skip
    return SavedState("boot", 1.0, 5, (Known(gen, rank, "/job", 4),), {9: 1}, {}, {10: ()}, (cg,), None,
                 (SavedIncident(gen, None, None, {10: (9, 3, "connector")}),),
                 {"j": (TimelinePoint(1.0, 5, 6, {"1": 100}, {"1": 200}, {}),)})  # fmt: skip


def targets() -> list[Target]:
    from sidecar.deaths import saved as journal
    from sidecar.diagnose import LogInput, diagnose
    from sidecar.errors import ParseError
    from sidecar.parse import flight, jobs, kernel, logs, memstat, oomd, ranks, torchrun
    from sidecar.probes import cgroup, host, proc
    from sidecar.redact import redact_argv, redact_text

    def agent(text: str) -> Any:
        return torchrun.exit_codes_by_pid(torchrun.parse_agent_text(text))

    def rank_text(text: str) -> Any:
        found = ranks.parse_rank_output(text)
        for f in found:
            if f.stamp is not None:
                ranks.stamp_to_epoch(f.stamp, 1796212358.0)
        return found

    def lines(fn: Callable[[str], Any]) -> Callable[[str], Any]:
        return lambda text: [fn(line) for line in text.splitlines()[:400]]

    def kmsg(data: bytes) -> Any:
        rec = kernel.parse_kmsg_record(data)
        if rec is not None:
            kernel.parse_oom_line(rec.text)
            kernel.parse_xid_line(rec.text)
        return rec

    def environ(data: bytes) -> Any:
        return proc.parse_rank_env(proc.parse_environ(data))

    def cmdline(data: bytes) -> Any:
        return proc.entrypoint_of(proc.parse_cmdline(data))

    def diag(texts: list[str]) -> Any:
        return diagnose([LogInput(f"in{i}", t) for i, t in enumerate(texts)], now=1796300000.0)

    kmsg_inputs = st.one_of(
        st.builds(lambda t: b"6,1,2,-;" + t.encode(), mutated("kernel")), st.binary(max_size=3000)
    )
    error_files = st.one_of(
        mutated("rank"),
        st.builds(
            json.dumps,
            st.dictionaries(
                st.text(max_size=10),
                st.one_of(st.text(), st.integers(), st.dictionaries(st.text(max_size=10), st.text())),
            ),
        ),
    )

    def dump(data: bytes) -> Any:
        return flight.summarise([flight.parse_dump(data, 0, "dump")], (0, 1))

    def memory_stat(text: str) -> Any:
        stat = memstat.parse_memory_stat(text)
        return memstat.charge_of(stat, 1, 1 << 30, 1 << 20), memstat.charge_of(stat, 2, None)

    def state(value: Any) -> Any:
        return journal.decode(value)

    real_state = json.loads(json.dumps(journal.encode(_a_state())))
    states = st.one_of(
        st.just(real_state),
        st.builds(lambda k, v: {**real_state, k: v}, st.sampled_from(sorted(real_state)), _json_values()),
        _json_values(),
    )
    rollup_lines = (FIXTURES / "smaps" / "python-32mib.smaps_rollup").read_text().splitlines()
    rollups = st.lists(
        st.one_of(st.sampled_from(rollup_lines), st.text(max_size=40), st.just("Pss: " + "9" * 25 + " kB")),
        max_size=40,
    ).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass"))
    parse_error = (ParseError,)
    return [
        Target("/proc/PID/smaps_rollup", proc.parse_smaps_rollup, rollups, parse_error),
        Target("cgroup memory.stat", memory_stat, mutated("any")),
        Target("journal state", state, states, (ValueError, TypeError, KeyError, AttributeError)),
        Target("kmsg record", kmsg, kmsg_inputs),
        Target("kernel OOM/Xid line", lines(kernel.parse_oom_line), mutated("kernel")),
        Target("kernel Xid line", lines(kernel.parse_xid_line), mutated("kernel")),
        Target("kernel log (any style)", logs.kernel_lines, mutated("kernel")),
        Target("kernel task row", lines(logs.parse_task_row), mutated("kernel")),
        Target("line time", lines(logs.line_time), mutated("any")),
        Target("torchrun agent log", agent, mutated("agent")),
        Target("torchrun error file", torchrun.parse_error_file, error_files, (ValueError,)),
        Target("rank output", rank_text, mutated("rank")),
        Target("OOM daemon line", lines(oomd.parse_userspace_oom_line), mutated("jobs")),
        Target("job manager line", lines(jobs.parse_job_line), mutated("jobs")),
        Target("flight-recorder dump", dump, dump_payloads(), (ValueError,)),
        Target("/proc/PID/stat", proc.parse_stat, mutated_bytes("stat"), parse_error),
        Target("/proc/PID/stat brief", proc.parse_stat_brief, mutated_bytes("stat"), parse_error),
        Target("/proc/PID/status", proc.parse_status, mutated_bytes("status"), parse_error),
        Target("/proc/PID/environ", environ, mutated_bytes("environ"), parse_error),
        Target("/proc/PID/cmdline", cmdline, mutated_bytes("cmdline"), parse_error),
        Target("/proc/PID/cgroup", cgroup.parse_proc_cgroup, mutated_bytes("cgroup"), parse_error),
        Target("mountinfo", cgroup.parse_mountinfo, mutated("any"), parse_error),
        Target("cgroup limit", cgroup.parse_limit, st.text(max_size=40), parse_error),
        Target("cgroup flat keyed", cgroup.parse_flat_keyed, mutated("any"), parse_error),
        Target("/proc/meminfo", host.parse_meminfo, mutated_bytes("meminfo"), parse_error),
        Target("/proc/vmstat oom_kill", host.parse_vmstat_oom_kill, mutated_bytes("meminfo"), parse_error),
        Target("/proc/pressure/memory", host.parse_psi, mutated_bytes("memory"), parse_error),
        Target("diagnose inputs", diag, st.lists(mutated("any"), min_size=1, max_size=3)),
        Target("redactor", redact_text, mutated("any")),
        Target("redactor argv", redact_argv, st.lists(st.text(max_size=60), max_size=12)),
    ]


@dataclass
class Outcome:
    name: str
    calls: int = 0
    worst_ms_per_kib: float = 0.0
    worst_input_bytes: int = 0
    worst_input: Any = None
    crashers: list[tuple[str, str]] = field(default_factory=list)


def _size(value: Any) -> int:
    if isinstance(value, (bytes, str)):
        return len(value.encode() if isinstance(value, str) else value)
    if isinstance(value, list):
        return sum(_size(v) for v in value)
    return 0


def run(target: Target, examples: int, randomize: bool = False) -> Outcome:
    """Feed ``examples`` inputs to ``target``; record crashers and the slowest call per KiB
    (of inputs of at least 1 KiB, where a rate means something)."""
    out = Outcome(target.name)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=not randomize,
        suppress_health_check=list(HealthCheck),
    )
    @given(target.inputs)
    def one(value: Any) -> None:
        out.calls += 1
        t0 = time.perf_counter()
        try:
            target.call(value)
        except target.allowed:
            pass
        except Exception as exc:  # a crasher: kept, and the run goes on
            if len(out.crashers) < 5:
                out.crashers.append((f"{type(exc).__name__}: {exc}"[:300], repr(value)[:2000]))
        size = _size(value)
        if size >= 1024:
            rate = (time.perf_counter() - t0) * 1000 / (size / 1024)
            if rate > out.worst_ms_per_kib:
                out.worst_ms_per_kib, out.worst_input_bytes, out.worst_input = rate, size, value

    one()
    return out


def retime(target: Target, value: Any, times: int = 7) -> float:
    """The fastest of several calls on one input, in ms per KiB: a slow input stays slow,
    a call that was slow because the machine was busy does not."""
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        with contextlib.suppress(*target.allowed, Exception):
            target.call(value)
        best = min(best, time.perf_counter() - t0)
    return best * 1000 / max(_size(value) / 1024, 1e-9)


def regressions() -> list[tuple[str, Any]]:
    """Inputs that once crashed a target (tests/fixtures/fuzz-regressions/*.json)."""
    found = []
    for p in sorted(REGRESSIONS.glob("*.json")) if REGRESSIONS.exists() else []:
        doc = json.loads(p.read_text())
        value: Any = doc["input"]
        if doc.get("bytes"):
            value = bytes.fromhex(value)
        found.append((doc["target"], value))
    return found


def budget() -> int:
    return int(os.environ.get("TRAINWATCH_FUZZ_EXAMPLES", "150"))
