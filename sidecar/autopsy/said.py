"""What the dead rank's own words and the GPU say: its watchdog's or its backend's timeout,
a CUDA OOM, a shared-memory bus error, an exception (from its output and error file, so
first-hand), any message of the emitter catalog that names how it ended (a mechanism before
a symptom, a report of what happened elsewhere last and only as possible; none whose kind
cannot have ended it the way it ended: ``fits``), and NVRM Xid records or a GPU NVML
reports lost near the death. The killers' rules (``killers.py``) ask these before they fall
back on signals and counters.
"""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass
from typing import Any

from sidecar.autopsy.evidence import Evidence, EvidenceItem, RankState, Step, rank_label, rank_name
from sidecar.autopsy.ranking import ends_with, fits, strongest, weaker
from sidecar.catalog import catalog
from sidecar.model import Confidence, Kind
from sidecar.parse.kernel import GPU_FAULT_XIDS
from sidecar.parse.ranks import Finding

__all__ = ["WAITING", "findings_of", "from_output", "gpu_fault"]


WAITING = ("nccl_timeout", "gloo_timeout", "peer_closed", "nccl_aborted")


def findings_of(rank: RankState, ev: Evidence, *kinds: str) -> list[Finding]:
    return [f for label, f in ev.output if label == rank.label and (not kinds or f.kind in kinds)]


def _entered(rank: RankState, ev: Evidence, seq: str | None) -> bool:
    """The rank's watchdog says it enqueued work ``seq`` or later (``last enqueued NCCL work:
    1582``): it reached the collective, whatever else it said."""
    if seq is None or not seq.isdigit():
        return False
    return any(
        (f.get("last_enqueued") or "-1").lstrip("-").isdigit()
        and int(f.get("last_enqueued") or -1) >= int(seq)
        for f in findings_of(rank, ev, "nccl_progress")
    )


def gpu_fault(victim: RankState, ev: Evidence) -> Step:
    """An NVRM Xid near the death: naming the rank's pid (certain), or one of the Xids that
    mean the hardware failed (a GPU off the bus, uncorrectable ECC, GSP errors: likely).
    Else a GPU NVML reports lost by the time of the death: the rank's own (likely), or
    any one when the rank's GPUs are not known (possible). The record it cites with it."""
    if victim.died_ns is None:
        return Step()
    who = rank_name(victim.label, victim.pid, ev.from_logs)
    near = [(ns, x) for ns, x in ev.xids if abs(ns - victim.died_ns) <= 120 * 10**9]
    named = [(ns, x) for ns, x in near if x.pid is not None and x.pid in (victim.pid, *victim.ns_pids)]
    faults = named or [(ns, x) for ns, x in near if x.xid in GPU_FAULT_XIDS]
    if faults:
        ns, x = faults[0]
        what = x.detail.rstrip(".") or f"Xid {x.xid}"
        return Step(
            (EvidenceItem("kmsg", ns, f"NVRM: Xid ({x.bus}): {x.xid}, {x.detail}"),),
            verdict=(
                Kind.GPU_ERROR,
                Confidence.CERTAIN if named else Confidence.LIKELY,
                f"{who} died as the GPU at {x.bus} failed: Xid {x.xid} ({what})"
                + ("; the driver named this process." if named else "."),
            ),
        )
    lost = [g for g in ev.lost_gpus if g[0] <= victim.died_ns + 120 * 10**9]
    mine = [g for g in lost if g[1] in victim.gpus]
    pick = mine or (lost if not victim.gpus else [])
    if not pick:
        return Step()
    ns, index, name = pick[0]
    gpu = f"GPU {index}" + (f" ({name})" if name else "")
    item = EvidenceItem("nvml", ns, f"{gpu}: NVML_ERROR_GPU_IS_LOST (the GPU fell off the bus)")
    if mine:
        return Step(
            (item,),
            verdict=(
                Kind.GPU_ERROR,
                Confidence.LIKELY,
                f"{who} died as its {gpu} was lost: NVML reports it off the bus.",
            ),
        )
    return Step(
        (item,),
        verdict=(
            Kind.GPU_ERROR,
            Confidence.POSSIBLE,
            f"{who} died while {gpu} was lost (NVML reports it off the bus); "
            "which GPU the rank used is not known.",
        ),
    )


def _as_its_peers(victim: RankState, ev: Evidence, who: str) -> Step:
    """A rank that exited with status 1 (an uncaught exception) whose own words the logs do
    not hold, while every other rank whose words say it failed of its own ran out of GPU
    memory: ranks of one job run the same code on the same sizes and fail alike, so that is
    its likeliest failure too, but nothing of its own says so (possible)."""
    kinds: set[Kind] = set()
    cited: list[Finding] = []
    for r in ev.ranks:
        if r is victim or r.pid in ev.agent_teardown:
            continue
        own = findings_of(r, ev, Kind.CUDA_OOM.value)
        others = [f for f in findings_of(r, ev) if f.kind not in (Kind.CUDA_OOM.value, "exception", "said")]
        if own and not others:
            kinds.add(Kind.CUDA_OOM)
            cited.append(own[0])
        elif findings_of(r, ev, "exception"):
            kinds.add(Kind.PYTHON_EXCEPTION)  # another failure: nothing tells which is its
    if kinds != {Kind.CUDA_OOM}:
        return Step()
    return Step(
        (_cited(cited[0]),),
        verdict=(
            Kind.CUDA_OOM,
            Confidence.POSSIBLE,
            f"{who} exited with status 1 (an uncaught exception) and its own words are not in these logs; "
            "every other rank that failed of its own ran out of GPU memory, as ranks of one job running "
            "the same code do alike: most likely it did too.",
        ),
    )


def _cited(f: Finding) -> EvidenceItem:
    """A finding as evidence, at the time its line carries (None when it has none)."""
    where = f.get("file")
    if where is not None:
        return EvidenceItem("error_file", f.at_ns, f"{where}: {f.line}")
    return EvidenceItem("output", f.at_ns, f.line)


def _all_terminated(ev: Evidence) -> bool:
    """Every rank that ended, ended by SIGTERM."""
    dead = [r for r in ev.ranks if r.dead and (r.signal is not None or r.returncode not in (None, 0))]
    return bool(dead) and all(r.signal == _signal.SIGTERM for r in dead)


def _one_end_no_prefix(victim: RankState, ev: Evidence) -> bool:
    """No line of the output read names its rank, and every rank that ended with an error
    ended with the victim's status, none by a signal."""
    if not ev.output or any(label is not None for label, _ in ev.output):
        return False
    failed = [r for r in ev.ranks if r.dead and (r.returncode not in (None, 0) or r.signal is not None)]
    return all(r.signal is None and r.returncode == victim.returncode for r in failed)


def from_output(victim: RankState, ev: Evidence) -> Step:
    """The verdict the victim's own output gives: its watchdog's or its backend's timeout,
    a CUDA OOM, a shared-memory bus error, an exception. First-hand, so certain. With it the
    lines it cites (those a rule cited without deciding too) and what it found as data (see
    ``Facts``). Whose words they are first, then each rule of ``_OWN_WORDS`` in order: the
    first that holds decides."""
    mine, confidence, who = _whose_words(victim, ev)
    if not mine and ev.from_logs and victim.status == 1 and victim.signal is None:
        return _as_its_peers(victim, ev, who)
    if not mine or victim.returncode == 0:
        return Step()
    w = _Words(victim, ev, mine, confidence, who)
    items: list[EvidenceItem] = []
    facts: dict[str, Any] = {}
    for rule in _OWN_WORDS:
        found = rule(w)
        items += found.items
        facts.update(found.facts)
        if found.verdict is not None:
            return Step(tuple(items), facts, found.verdict)
    return Step(tuple(items), facts)


def _whose_words(victim: RankState, ev: Evidence) -> tuple[list[Finding], Confidence, str]:
    """The findings that are the victim's own words, how sure that they are, and how the
    summary names it (lines with no rank prefix are its own only in the cases below)."""
    who = rank_name(victim.label, victim.pid, ev.from_logs)
    mine = findings_of(victim, ev)
    confidence = Confidence.CERTAIN
    if not mine and victim.returncode != 0:  # an error status, or one nobody could tell
        # Lines with no rank prefix (a rank that never initialised torch.distributed does
        # not get one): they are the victim's only when it alone ended with an error.
        alone = len(ev.ranks) == 1 or not any(
            r is not victim and r.dead and r.returncode not in (None, 0) and r.signal is None
            for r in ev.ranks
        )
        if alone and victim.signal is None:
            mine = [f for label, f in ev.output if label is None]
            confidence = Confidence.LIKELY if len(ev.ranks) > 1 else Confidence.CERTAIN
        elif victim.signal is None and _one_end_no_prefix(victim, ev):
            # several ranks ended with this status and no line carries a rank: the words
            # are one of theirs (srun without -l, one shared file), which one nobody knows
            mine = [f for label, f in ev.output if label is None]
            confidence = Confidence.POSSIBLE
            ended = sum(1 for r in ev.ranks if r.dead and r.returncode == victim.returncode)
            who = f"One of the {ended} ranks that exited with status {victim.status} (no line says which)"
        elif victim.signal is not None and not any(
            r is not victim and r.dead and r.signal == victim.signal for r in ev.ranks
        ):
            # killed by a signal no other rank died of: an unprefixed message that says the
            # same end (glibc's "double free" before its SIGABRT, a UCX SIGSEGV banner) is
            # its own; nothing else unprefixed is
            mine = [
                f
                for label, f in ev.output
                if label is None
                and f.kind == "said"
                and f.get("layer") in ("mechanism", "symptom")
                and ends_with(Kind(f.get("said_kind") or "unknown"), victim.signal)
            ]
            confidence = Confidence.LIKELY
        elif victim.signal == _signal.SIGTERM and _all_terminated(ev):
            # every death the logs give is a SIGTERM: what a launcher sends every rank once
            # something failed. A device fault in lines that name no rank (its CUDA context
            # lost, that rank could not go on) is that failure; whose, no line says
            mine = [
                f
                for label, f in ev.output
                if label is None
                and f.kind == "said"
                and f.get("layer") in ("mechanism", "symptom")
                and f.get("said_kind") == Kind.GPU_ERROR
            ]
            confidence = Confidence.POSSIBLE
            who = "A rank (no line says which)"
    return mine, confidence, who


@dataclass(frozen=True, slots=True)
class _Words:
    """The victim's own words, how sure that they are its own, and how the summary names it:
    what every rule of ``_OWN_WORDS`` reads."""

    victim: RankState
    ev: Evidence
    mine: list[Finding]
    confidence: Confidence
    who: str

    def of(self, *kinds: str) -> list[Finding]:
        return [f for f in self.mine if f.kind in kinds]


def _cites(found: list[Finding]) -> tuple[EvidenceItem, ...]:
    """The first three of ``found``, as a rule cites them."""
    return tuple(_cited(f) for f in found[:3])


def _timed_out(w: _Words) -> Step:
    """Its watchdog's or gloo's timeout, read field by field; who never arrived."""
    confidence = w.confidence
    nccl = w.of("nccl_timeout")
    gloo = [] if nccl else w.of("gloo_timeout")
    if nccl or gloo:
        items = [*_cites(nccl or gloo), *_cites(w.of("nccl_progress"))]
        exc = next((f for f in w.mine if f.kind == "exception" and f.get("collective")), None)
        first = nccl[0] if nccl else gloo[0]
        backend = "NCCL" if nccl else "gloo"
        facts: dict[str, Any] = {"backend": "nccl" if nccl else "gloo"}
        op = (nccl[0].get("op") or "").lower() if nccl else (exc.get("collective") if exc else None)
        seq = first.get("seq")
        what = (op or "a collective") + (f" (SeqNum {seq})" if seq else "")
        waited = int(first.get("timeout_ms") or 0) / 1000
        missing = _never_arrived(w.victim, w.ev, seq)
        fr = w.ev.flight
        if fr is not None:  # sequence numbers beat inference from who said what
            missing = [
                r for r in missing if r.rank is None or r.rank not in fr.dumped or r.rank in fr.laggards
            ]
            items += [EvidenceItem("flight_recorder", None, line) for line in fr.lines]
            if fr.laggards:
                what = (fr.op or op or "a collective") + f" (SeqNum {fr.seq})"
        else:
            items += [
                EvidenceItem(
                    "output",
                    None,
                    f"{rank_name(r.label, r.pid, w.ev.from_logs)} was alive and reported no timeout: "
                    "it never joined",
                )
                for r in missing
            ]
        if fr is not None and fr.laggards:
            never = f"; rank {', '.join(map(str, fr.laggards))} never entered it (flight recorder)"
        elif missing:
            never = (
                f"; {rank_label(missing[0].label, w.ev.from_logs)}"
                + "".join(f", {r.label}" for r in missing[1:])
                + " never arrived"
            )
        elif len(w.ev.ranks) == 1 and w.ev.world_size == 1:
            facts["all_entered"] = True
            never = (
                "; it is the whole world, so its own work held the collective up (a GPU kernel ahead of it)"
            )
        elif fr is not None and w.ev.world_size is not None and len(fr.dumped) == w.ev.world_size:
            facts["all_entered"] = True
            never = (
                "; every rank entered it (flight recorder), so the collective itself did not finish "
                "(the network, NCCL, or GPU work queued ahead of it)"
            )
        else:
            never = "; every rank here was waiting (the one that never arrived is elsewhere)"
            if w.ev.from_logs:
                # the logs hold only ranks that waited: what kept the missing one away (a
                # crash, an OOM, a hang on another node) is the job's killer, and they do
                # not show it
                confidence = Confidence.POSSIBLE
                never += ": what kept it away is the job's root cause, and these logs do not show it"
        named = f"the {backend} {what}" if op else f"a {backend} collective" + what[len("a collective") :]
        return Step(
            tuple(items),
            facts,
            (
                Kind.COLLECTIVE_TIMEOUT,
                confidence,
                f"{w.who}: {named} did not complete within {waited:g} s{never}.",
            ),
        )
    return Step()


def _watchdog_stuck(w: _Words) -> Step:
    """The heartbeat monitor gave up on its watchdog."""
    stuck = w.of("nccl_heartbeat")
    if stuck:
        return Step(
            _cites(stuck),
            {"backend": "nccl"},
            (
                Kind.COLLECTIVE_TIMEOUT,
                Confidence.LIKELY,
                f"{w.who}: its NCCL watchdog got stuck (the heartbeat monitor gave up on it): a collective "
                "or a CUDA call it waits on hung, and the process was ended for it.",
            ),
        )
    return Step()


def _out_of_gpu_memory(w: _Words) -> Step:
    """The caching allocator's out-of-memory, with its sizes when it gave them."""
    confidence = w.confidence
    oom = w.of(Kind.CUDA_OOM)
    if oom:
        f = oom[0]
        if f.get("requested_bytes") is None:  # no sizes: "CUDA error: out of memory", a cut message
            words = (
                "CUDA error: out of memory" if "CUDA error: out of memory" in f.line else "CUDA out of memory"
            )
            return Step(
                _cites(oom), verdict=(Kind.CUDA_OOM, confidence, f"{w.who} ran out of GPU memory ({words}).")
            )
        gib = int(f.get("requested_bytes") or 0) / 2**30
        gpu = f.get("gpu")
        extra = ""
        if f.get("total_bytes"):
            extra = f" of {int(f.get('total_bytes') or 0) / 2**30:.1f} GiB"
            if f.get("free_bytes"):
                extra += f", {int(f.get('free_bytes') or 0) / 2**30:.2f} GiB free"
        on = f" on GPU {gpu}" if gpu is not None else ""
        return Step(
            _cites(oom),
            verdict=(
                Kind.CUDA_OOM,
                confidence,
                f"{w.who} ran out of GPU memory{on}: it tried to allocate {gib:.2f} GiB{extra}.",
            ),
        )
    return Step()


def _shared_memory(w: _Words) -> Step:
    """A DataLoader worker's bus error, or a batch that found /dev/shm full. A DataLoader
    worker killed by another signal is cited, and the next rule goes on."""
    confidence = w.confidence
    bus = w.of("shm_bus_error")
    killed = [] if bus else w.of("dataloader_killed")
    items = _cites(bus or killed)
    shm = bus or [f for f in killed if (f.get("signal") or "").lower().startswith("bus")]
    size = ""
    if w.ev.shm is not None:
        total, used, before_s = w.ev.shm
        when = "" if before_s is None else f", {before_s:.1f} s before the death"
        size = f" ({used / 2**20:.1f} MiB used of {total / 2**20:.1f} MiB{when})"
    if shm:
        return Step(
            items,
            {"shm_exhausted": True},
            (
                Kind.BUS_ERROR,
                confidence,
                f"{w.who} failed with a bus error in a DataLoader worker: /dev/shm (shared memory) ran out"
                f"{size}.",
            ),
        )
    full = w.of("shm_full")
    if full:
        return Step(
            items + _cites(full),
            {"shm_exhausted": True},
            (
                Kind.PYTHON_EXCEPTION,
                confidence,
                f"{w.who} could not get shared memory for a DataLoader batch: /dev/shm ran out{size} "
                "(No space left on device).",
            ),
        )
    return Step(items)


def _catalogued(w: _Words) -> Step:
    """The catalog's words: a mechanism, else how it ended, else its exception, else a
    report of what happened elsewhere."""
    confidence = w.confidence
    said = [
        f
        for f in w.mine
        if f.kind == "said" and fits(Kind(f.get("said_kind") or "unknown"), w.victim.signal, w.victim.status)
    ]
    mechanism = strongest(said, "mechanism")
    if mechanism is not None:
        if (
            mechanism.get("said_kind") == Kind.COLLECTIVE_TIMEOUT.value
            and w.ev.from_logs
            and w.ev.flight is None
            and not (len(w.ev.ranks) == 1 and w.ev.world_size == 1)
            and not _never_arrived(w.victim, w.ev, mechanism.get("seq"))
        ):
            # as for the watchdog's lines read field by field: the logs hold only ranks that
            # waited, and what kept the missing one away is not in them
            confidence = Confidence.POSSIBLE
        return _from_catalog(w.who, mechanism, confidence)
    exc_found = [f for f in w.mine if f.kind == "exception"]
    symptom = strongest(said, "symptom")
    if symptom is not None and (not exc_found or w.victim.signal is not None or w.victim.status is None):
        # how it ended (an abort, a fault banner), where no exception or a signal says so
        return _from_catalog(w.who, symptom, confidence)
    if exc_found and w.victim.status not in (None, 0):
        f = exc_found[-1]
        return Step((_cited(f),), verdict=(Kind.PYTHON_EXCEPTION, confidence, f"{w.who} raised {f.line}"))
    report = strongest(said, "report")
    if report is not None:  # its own words tell only what happened elsewhere
        return _from_catalog(w.who, report, Confidence.POSSIBLE)
    return Step()


_OWN_WORDS = (_timed_out, _watchdog_stuck, _out_of_gpu_memory, _shared_memory, _catalogued)


def _never_arrived(victim: RankState, ev: Evidence, seq: str | None) -> list[RankState]:
    """The ranks alive at the victim's timeout that neither waited (the watchdog's lines read
    field by field, or its words found by the catalog) nor entered the collective (``seq``):
    the ones it waited for."""

    def waited(r: RankState) -> bool:
        return bool(findings_of(r, ev, *WAITING)) or any(
            f.kind == "said"
            and f.get("said_kind") == Kind.COLLECTIVE_TIMEOUT.value
            and f.get("layer") == "mechanism"
            for f in findings_of(r, ev)
        )

    return [
        r
        for r in ev.ranks
        if r is not victim
        and not waited(r)
        and not _entered(r, ev, seq)
        and (r.died_ns is None or victim.died_ns is None or r.died_ns >= victim.died_ns)
    ]


def _from_catalog(who: str, f: Finding, confidence: Confidence) -> Step:
    """A catalog message's verdict: its kind, at the lower of its ceiling and what the line's
    attribution to the rank allows (never certain when it is not first-hand); it cites the
    line and the message."""
    message = catalog().by_id.get(f.get("id") or "")
    if message is None:  # a finding from a catalog this process no longer holds
        return Step(verdict=(Kind.UNKNOWN, Confidence.POSSIBLE, f"{who}: {f.line}"))
    ceiling = Confidence(f.get("ceiling") or "possible")
    if not message.first_hand and ceiling == Confidence.CERTAIN:
        ceiling = Confidence.LIKELY
    if message.untold_sigterm(f.get("signal")):
        ceiling = weaker(ceiling, Confidence.POSSIBLE)
    sure = weaker(ceiling, confidence)
    items = (_cited(f), EvidenceItem("catalog", None, f"{message.id}: {message.mechanism}"))
    if f.get("terminated"):  # its words, in the what() of an exception nothing caught
        told = message.told(who, f.fields).rstrip(".")
        why = "thrown where nothing caught it, so std::terminate aborted the process"
        return Step(items, verdict=(Kind.ABORT, sure, f"{told}; {why}."))
    return Step(items, verdict=(message.kind or Kind.UNKNOWN, sure, message.told(who, f.fields)))
