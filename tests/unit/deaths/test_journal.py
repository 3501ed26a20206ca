"""The death watch's journal: what it keeps on disk, what a restarted daemon reads back,
and which deaths it judges again. The restart itself, with a real death while no daemon
ran, is tests/e2e/test_faults.py::test_a_death_while_the_daemon_was_down_is_explained_on_restart."""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import replace
from pathlib import Path

from sidecar.deaths.engine import DeathWatch
from sidecar.deaths.gather import Gatherer
from sidecar.deaths.journal import STATE_NAME, Journal
from sidecar.deaths.reconstruct import revive
from sidecar.deaths.saved import SavedIncident, SavedState
from sidecar.model import CgroupLevel, CgroupSample, MemoryCharge, ProcKey
from sidecar.parse.kernel import parse_kmsg_record
from sidecar.postmortem import PostmortemStore
from sidecar.probes.outputs import OutputFile
from sidecar.sampling.timeline import Timeline
from tests.support.e2e import wait_for
from tests.support.skips import left_out
from tests.support.snapshots import make_job, make_snapshot


def _watch(tmp_path, boot="boot-1", proc="no-proc") -> tuple[DeathWatch, PostmortemStore]:
    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(
        store,
        Timeline(300, 1),
        Gatherer(proc_root=str(tmp_path / proc)),
        hostname="h",
        journal=Journal(str(tmp_path)),
        boot_id=boot,
    )
    return watch, store


def _cgroup() -> CgroupSample:
    return CgroupSample(
        "/job",
        1,
        900,
        1000,
        950,
        0,
        0,
        (CgroupLevel("/", None),),
        limited_by="/job",
        effective_limit_bytes=1000,
        charge=MemoryCharge(600, 100, 150, None, 800, 100),
        events={"max": 3, "oom_kill": 0},
        pressure_ratio=(0.25, None),
        pressure_stall_seconds=(1.5, None),
    )


def test_the_journal_holds_what_a_restart_needs_and_reads_back_only_for_its_boot(tmp_path, caplog):
    watch, _ = _watch(tmp_path)
    job = make_job("a", 100)
    job = replace(job, ranks=(replace(job.ranks[0], cgroup="/job", uid=1000, error_file="/tmp/e.json"),))
    snap = replace(make_snapshot(1, (job,)), cgroups=(_cgroup(),))
    watch.observe(snap)
    path = tmp_path / STATE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    state = Journal(str(tmp_path)).load("boot-1")
    assert state is not None
    (known,) = state.ranks
    assert known.sample == job.ranks[0]  # every field, through JSON and back
    assert known.gen.job == "a" and known.gen.agent_pid == 9 and state.agents == {9: 1}
    assert state.cgroups == (_cgroup(),)
    assert Journal(str(tmp_path)).load("boot-2") is None, "another boot's pids mean nothing"
    path.write_text(json.dumps({"schema": "trainwatch.state/v1", "boot_id": "boot-1", "ranks": [{"gen": 5}]}))
    with caplog.at_level(logging.WARNING):
        assert Journal(str(tmp_path)).load("boot-1") is None
    assert "malformed" in caplog.text


def test_a_rank_gone_without_a_trace_gives_no_postmortem_after_a_restart(tmp_path, caplog):
    """The job may simply have ended while the daemon was down: no record, no failing exit,
    no counter says otherwise, so nothing is written (an 'unknown' would be noise)."""
    first, _ = _watch(tmp_path)
    first.observe(make_snapshot(1, (make_job("a", 100),)))
    state = Journal(str(tmp_path)).load("boot-1")
    assert state is not None
    second, store = _watch(tmp_path)
    with caplog.at_level(logging.INFO):
        assert second.restore(state) == 1  # judged: pid 10 is not alive under the fake /proc
        second.start()
        try:
            wait_for(
                lambda: "trainwatch was down when they ended" in caplog.text,
                10,
                "the restored incident to be judged",
            )
        finally:
            second.stop()
    assert store.newest() is None


def test_a_kernel_oom_record_in_the_history_explains_a_death_while_down(tmp_path):
    first, _ = _watch(tmp_path)
    first.observe(replace(make_snapshot(1, (make_job("a", 100),)), cgroups=(_cgroup(),)))
    state = Journal(str(tmp_path)).load("boot-1")
    assert state is not None
    second, store = _watch(tmp_path)
    at_us = 5_000_000  # after the rank's start (1 tick), as the history replay would feed it
    for raw in (
        f"6,567,{at_us},-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        "oom_memcg=/job,task_memcg=/job,task=python3,pid=10,uid=0",
        f"3,568,{at_us + 40},-;Memory cgroup out of memory: Killed process 10 (python3) total-vm:119004kB, "
        "anon-rss:102016kB, file-rss:6600kB, shmem-rss:0kB, UID:0 pgtables:268kB oom_score_adj:0",
    ):
        second.on_kmsg(parse_kmsg_record(raw.encode()))
    second.restore(state)
    second.start()
    try:
        doc = wait_for(store.newest, 10, "the reconstructed postmortem")
    finally:
        second.stop()
    k = doc["killer"]
    assert (k["kind"], k["confidence"]) == ("cgroup_oom", "certain"), k
    assert doc["victim"]["pid"] == 10 and "reconstructed" in doc
    assert k["evidence"][-1]["source"] == "trainwatch" and k["evidence"][-1]["detail"].startswith(
        "reconstructed"
    )


def test_deaths_a_saved_incident_holds_are_not_judged_again():
    """Killed mid-incident: the deaths the postmortem already has stay as they were told
    (first-hand), only the ones after them are new, and the postmortem keeps its id."""
    job = make_job("a", 100)
    rank0 = job.ranks[0]
    rank1 = replace(rank0, rank=1, rank_label="1", key=ProcKey(11, 1))
    from sidecar.deaths.incidents import Generation, Known

    gen = Generation("a", 9, None, 2, 0, "t.py")
    ranks = (Known(gen, rank0, None, 100), Known(gen, rank1, None, 100))
    saved = SavedIncident(gen, "20261203T000000Z-h-9-r0", 1.0, {10: (9, 50, "connector")})
    state = SavedState("b", 1.0, 100, ranks, {9: 1}, {}, {}, (), None, (saved,), {})
    (r,) = revive(state, alive=lambda key: False, killed_at=lambda key: None, now_ns=500)
    assert r.doc_id == saved.doc_id and r.new_dead == (11,) and r.untimed == frozenset({11})
    assert r.deaths == {10: (9, 50, "connector"), 11: (None, 500, "reconstructed")}
    assert not r.agent_alive
    # every rank alive, or every death already told: nothing to judge
    assert revive(state, alive=lambda key: key.pid == 11, killed_at=lambda key: None, now_ns=500) == []


def test_the_journal_is_written_by_a_path_no_one_else_owns(tmp_path):
    """Symlinks planted where the two slots go are removed, never followed, and a state
    owned by another user is not read."""
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    j = Journal(str(tmp_path))
    for path in j.paths:
        os.symlink(target, path)
    files = (OutputFile(9, 1, "/x/train.log", 2, 3, 4),)
    j.save(SavedState("b", 1.0, 1, (), {9: 1}, {9: files}, {10: ()}, (), None, (), {}))
    j.save(SavedState("b", 2.0, 2, (), {9: 1}, {9: files}, {10: ()}, (), None, (), {}))
    assert target.read_text() == "keep"
    assert all(not os.path.islink(p) and stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in j.paths)
    state = j.load("b")
    assert state is not None and state.agent_files == {9: files} and state.rank_files == {10: ()}
    assert state.saved_ns == 2
    other = 65534 if os.getuid() != 65534 else 65533  # nobody, unless the suite runs as nobody
    try:
        for path in j.paths:
            os.chown(path, other, other)
    except PermissionError:  # giving a file away takes root
        left_out("root", "a state owned by another user is not read")
        return
    assert j.load("b") is None


def test_a_save_cut_short_spoils_only_its_own_slot(tmp_path, caplog):
    """The slots are written in turn, in place: the newer state is read back; where its slot
    was left half-written (the daemon killed in the middle of the write), the other one is;
    a slot removed under the daemon is made again at its next turn."""
    j = Journal(str(tmp_path))

    def state(n: int, agents: int = 1) -> SavedState:
        return SavedState("b", float(n), n, (), {pid: n for pid in range(agents)}, {}, {}, (), None, (), {})

    j.save(state(1))
    j.save(state(2, agents=50))
    j.save(state(3))  # slot 0 holds 1 then 3, slot 1 holds 2
    first, second = map(Path, j.paths)
    assert j.load("b").saved_ns == 3
    j.save(state(4))  # shorter than slot 1's last: the older text is blanked, not left behind
    now = {"saved_ns": 4, "saved_wall": 4.0, "agents": [[0, 4]]}
    assert json.loads(second.read_bytes()) == json.loads(first.read_bytes()) | now
    raw = second.read_bytes()
    second.write_bytes(raw[: len(raw) // 2] + b"\0" * (len(raw) - len(raw) // 2))  # a write killed half-way
    with caplog.at_level(logging.WARNING):
        assert j.load("b").saved_ns == 3
    assert "malformed" in caplog.text
    first.unlink()
    j.save(state(5))  # slot 0's turn: its file is gone, a new one is made
    assert j.load("b").saved_ns == 5 and first.exists()
    os.unlink(second)
    os.link(first, second)  # a second name for slot 0's file: slot 1 is made afresh, not written through it
    j.save(state(6))
    assert json.loads(first.read_bytes())["saved_ns"] == 5 and j.load("b").saved_ns == 6


def test_a_new_rank_is_journaled_in_its_round_and_the_rest_once_a_second(tmp_path):
    """At 10 Hz the death watch keeps each round's samples but tidies (forgets the gone,
    checks the journal) once a second: a rank that appears is journaled in the round it
    appears in; one that is gone drops out at the next tidy, within a second."""
    clock = [0]
    watch = DeathWatch(
        PostmortemStore(str(tmp_path)),
        Timeline(300, 0.1),
        Gatherer(proc_root=str(tmp_path / "no-proc"), clock_ns=lambda: clock[0]),
        hostname="h",
        journal=Journal(str(tmp_path)),
        boot_id="boot-1",
        clock_ns=lambda: clock[0],
    )
    a = make_job("a", 100)
    both = replace(a, ranks=(*a.ranks, replace(a.ranks[0], rank=1, rank_label="1", key=ProcKey(11, 1))))

    def journaled() -> set[int]:
        state = Journal(str(tmp_path)).load("boot-1")
        assert state is not None
        return {k.sample.key.pid for k in state.ranks}

    watch.observe(make_snapshot(1, (a,)))
    assert journaled() == {10}
    clock[0] = 100_000_000
    watch.observe(make_snapshot(2, (both,)))
    assert journaled() == {10, 11}  # a new rank: at once
    clock[0] = 200_000_000
    watch.observe(make_snapshot(3, (a,)))
    assert journaled() == {10, 11}  # a rank gone: not yet
    clock[0] = 1_200_000_000
    watch.observe(make_snapshot(4, (a,)))
    assert journaled() == {10}  # the next tidy, a second after the last


def test_a_journal_saved_before_jobs_named_their_launcher_reads_back_as_torchrun():
    """A daemon upgraded mid-incident reads the journal its predecessor wrote: generations
    of six fields (no launcher) and ranks without rank_source were torchrun's, numbered by
    RANK; what is saved now reads back as it was."""
    from sidecar.deaths.incidents import Generation, Known
    from sidecar.deaths.saved import decode, encode

    job = make_job("a", 100)
    rank0 = replace(job.ranks[0], rank_source="order")
    gen = Generation("a", 9, None, 2, 0, "t.py", "deepspeed")
    state = SavedState("b", 1.0, 100, (Known(gen, rank0, None, 100),), {9: 1}, {}, {}, (), None, (), {})
    doc = json.loads(json.dumps(encode(state)))
    back = decode(doc)
    assert back.ranks[0].gen == gen and back.ranks[0].sample.rank_source == "order"
    old = json.loads(
        json.dumps(doc).replace('"t.py", "deepspeed"]', '"t.py"]').replace(', "rank_source": "order"', "")
    )
    assert old != doc
    was = decode(old)
    assert was.ranks[0].gen == replace(gen, launcher="torchrun") and was.ranks[0].sample.rank_source == "RANK"
