"""The autopsy's rules, evidence in, verdict out: OOM records, counters, the first death, the
agent's teardown, senders, and the exit events captured on the GPU machine."""

from __future__ import annotations

import json
import signal

import pytest

from sidecar.autopsy import Evidence, KernelOom, RankState, UserspaceKill, agent_name, autopsy
from sidecar.deaths.gather import Gatherer
from tests.support.oomd_lines import EARLYOOM_18, SYSTEMD_OOMD  # the daemons' real lines
from tests.support.paths import CAPTURES

S = 10**9


def _r(
    label: str, pid: int, code: int | None = None, at: float | None = None, cg: str = "/job", by: str = "/job"
):
    return RankState(
        label, int(label), int(label), pid, (), code, None if at is None else int(at * S), cg, by
    )


def test_cgroup_oom_is_certain_when_the_kernel_names_the_pid():
    oom = KernelOom(
        102, int(10.001 * S), "memcg", "/pod", "/pod/c", "python3", 5 << 30, ("oom-kill:...pid=102",)
    )
    v = autopsy(Evidence((_r("0", 101, 15, 10.05), _r("1", 102, 9, 10.0), _r("2", 103)), kernel=(oom,)))
    assert (
        v.kind == "cgroup_oom" and v.confidence == "certain" and v.victim.pid == 102 and "/pod" in v.summary
    )
    assert v.fates == {"0": "terminated_by_agent", "1": "root_cause", "2": "running"}


def test_global_oom_is_kernel_oom():
    oom = KernelOom(102, int(10 * S), "global", None, "/user.slice", "python3", 20 << 30, ())
    v = autopsy(Evidence((_r("0", 101, 15, 10.1), _r("1", 102, 9, 10.0)), kernel=(oom,)))
    assert v.kind == "kernel_oom" and v.confidence == "certain"


def test_root_cause_is_the_first_death_not_the_lowest_rank():
    v = autopsy(Evidence((_r("0", 101, 9, 10.2), _r("3", 104, 9, 10.0))))
    assert v.victim.label == "3" and v.fates["0"] == "terminated_by_agent"


def test_sigkill_without_record_or_counter_is_external_never_oom():
    v = autopsy(
        Evidence(
            (_r("0", 101, 15, 10.1), _r("1", 102, 9, 10.0)),
            host_oom_kills_before=7,
            host_oom_kills_after=7,
            cgroup_oom_kills_before={"/job": 0},
            cgroup_oom_kills_after={"/job": 0},
        )
    )
    assert v.kind == "external_signal" and v.confidence == "likely"
    blind = autopsy(Evidence((_r("1", 102, 9, 10.0),), kernel_log_readable=False))
    assert blind.kind == "external_signal" and blind.confidence == "possible"


def test_counters_without_a_record_are_likely_not_certain():
    """No record names the pid (the kernel log unread): the counters say which OOM killer, at
    most likely. A cgroup's oom_kill counts its processes killed by *any* OOM killer, the
    global one's too: it is the cgroup's own OOM only where the cgroup (or the level limiting
    it) reached its limit across the death (v2 memory.events oom, v1 failcnt)."""

    def judge(hits_after: int | None, by: str | None = "/job") -> tuple[str, str, str]:
        hits = (
            {}
            if hits_after is None
            else {"cgroup_limit_hits_before": {"/job": 3}, "cgroup_limit_hits_after": {"/job": hits_after}}
        )
        v = autopsy(
            Evidence(
                (_r("1", 102, 9, 10.0, by=by),),  # type: ignore[arg-type]
                host_oom_kills_before=7,
                host_oom_kills_after=8,
                cgroup_oom_kills_before={"/job": 0},
                cgroup_oom_kills_after={"/job": 1},
                kernel_log_readable=False,
                **hits,  # type: ignore[arg-type]
            )
        )
        return v.kind, v.confidence, v.summary

    reached = judge(4)
    assert reached[:2] == ("cgroup_oom", "likely") and "reached its limit" in reached[2], reached
    # the counter moved, the limit was never reached: another OOM killer's kill (the global
    # one's, or a wider limit's above the cgroup), never the cgroup's own OOM
    outside = judge(3)
    assert outside[:2] == ("kernel_oom", "possible") and "never reached its limit" in outside[2], outside
    # no level above the rank has a limit: only the global killer can have killed it
    assert judge(3, by=None)[:2] == ("kernel_oom", "likely")
    assert judge(None, by=None)[:2] == ("kernel_oom", "likely")
    # the limit hits unread: which killer is not known
    unread = judge(None)
    assert unread[:2] == ("cgroup_oom", "possible") and "could not be read" in unread[2], unread


def test_the_host_oom_counter_moved_by_another_job_s_kill_is_no_reason():
    """/proc/vmstat's oom_kill counts every OOM kill on the host, and the kernel writes "Killed
    process <pid>" for each (never rate-limited): where its log was read and lost nothing near
    the death, a kill -9 while other processes were OOM-killed (their records read or not yet:
    a record can reach the reader after the counter moved) is no OOM. Where the log could not
    be read, or lost records near the death, the counter's rise is an OOM at likely."""
    other = KernelOom(999, int(9.5 * S), "memcg", "/other", "/other", "python3", None, ())
    for after, kernel in ((8, (other,)), (9, (other,)), (8, ())):
        counters = {"host_oom_kills_before": 7, "host_oom_kills_after": after}
        v = autopsy(Evidence((_r("1", 102, 9, 10.0),), kernel=kernel, **counters))  # type: ignore[arg-type]
        assert v.kind == "external_signal", (after, kernel, v.kind, v.summary)
    counters = {"host_oom_kills_before": 7, "host_oom_kills_after": 8}
    blind = autopsy(Evidence((_r("1", 102, 9, 10.0),), kernel_log_readable=False, **counters))  # type: ignore[arg-type]
    assert (blind.kind, blind.confidence) == ("kernel_oom", "likely"), (blind.kind, blind.summary)
    lost = autopsy(Evidence((_r("1", 102, 9, 10.0),), kernel_losses=((int(9.9 * S), 3),), **counters))  # type: ignore[arg-type]
    assert (lost.kind, lost.confidence) == ("kernel_oom", "likely"), (lost.kind, lost.summary)


def test_the_agents_sigkill_30_s_later_is_teardown_not_oom():
    oom = KernelOom(102, int(10 * S), "memcg", "/job", "/job", "python3", None, ())
    v = autopsy(
        Evidence((_r("0", 101, 9, 40.1), _r("1", 102, 9, 10.0), _r("2", 103, 36608, 10.5)), kernel=(oom,))
    )
    assert v.fates == {"0": "terminated_by_agent", "1": "root_cause", "2": "terminated_by_agent"}


def test_two_ranks_killed_by_one_oom_are_same_cause():
    ooms = (
        KernelOom(102, int(10 * S), "global", None, None, "p", None, ()),
        KernelOom(101, int(10.01 * S), "global", None, None, "p", None, ()),
    )
    v = autopsy(Evidence((_r("0", 101, 9, 10.02), _r("1", 102, 9, 10.0)), kernel=ooms))
    assert v.fates == {"0": "same_cause", "1": "root_cause"}


def test_exit_status_and_unknowns():
    assert autopsy(Evidence((_r("1", 102, 256, 10.0),))).kind == "python_exception"
    assert autopsy(Evidence((_r("1", 102, 11, 10.0),))).kind == "segfault"
    assert autopsy(Evidence((_r("1", 102, None, 10.0),))).kind == "unknown"
    assert autopsy(Evidence((_r("1", 102),))) is None


@pytest.mark.parametrize(
    "name, victim, kind",
    [
        # A: rank 2 SIGKILLs itself (no OOM record, as a kill from outside leaves); rank 0
        # ignores SIGTERM and gets torchrun's SIGKILL 30 s later; rank 1 dies of SIGTERM;
        # rank 3 exits 143 from its handler.
        ("torchrun-A", 2, "external_signal"),
        # B: rank 1 raises an exception (exit 1); the others die of the agent's SIGTERM.
        ("torchrun-B", 1, "python_exception"),
    ],
)
def test_autopsy_on_real_exit_events_captured_on_the_gpu_machine(name, victim, kind):
    capture = json.loads((CAPTURES / f"{name}.json").read_text())
    pid_rank = {v["pid"]: int(v["RANK"]) for v in capture["env_files"].values() if "RANK" in v}
    exits = {e["pid"]: e for e in capture["cn_proc_exits_workers"]}
    ranks = tuple(
        RankState(str(r), r, r, pid, (), exits[pid]["exit_code"], int(exits[pid]["ts_mono"] * S))
        for pid, r in sorted(pid_rank.items(), key=lambda kv: kv[1])
    )
    v = autopsy(Evidence(ranks, host_oom_kills_before=3, host_oom_kills_after=3))
    assert v.victim.rank == victim and v.kind == kind
    assert v.fates == {
        str(r.rank): "root_cause" if r.rank == victim else "terminated_by_agent" for r in ranks
    }
    if name == "torchrun-A":
        r0 = next(r for r in ranks if r.rank == 0)
        assert (
            r0.signal == signal.SIGKILL and (r0.died_ns - v.victim.died_ns) / S > 29
        )  # the -9 that is no OOM


def test_the_tracepoint_names_the_sender():
    from sidecar.autopsy import SignalSent

    victim = _r("1", 102, 9, 10.0)
    by_kill = SignalSent("kill", 4242, 102, 9, 0, int(9.999 * S))
    v = autopsy(Evidence((_r("0", 101, 15, 10.05), victim), signals=(by_kill,)))
    assert (
        v.kind == "external_signal"
        and v.confidence == "certain"
        and "pid 4242 (kill) sent SIGKILL" in v.summary
    )
    by_earlyoom = SignalSent("earlyoom", 900, 102, 9, 0, int(9.999 * S))
    assert autopsy(Evidence((victim,), signals=(by_earlyoom,))).kind == "userspace_oom"
    by_agent = SignalSent("pt_elastic", 77, 102, 9, 0, int(9.999 * S))
    v = autopsy(Evidence((victim,), signals=(by_agent,), agent_pid=77))
    assert v.kind == "agent_teardown" and "by the torchrun agent (pid 77)" in v.summary
    # the launching process is named as what it is: mpirun's abort is no torchrun agent's
    by_mpirun = SignalSent("mpirun.openmpi", 77, 102, 9, 0, int(9.999 * S))
    v = autopsy(Evidence((victim,), signals=(by_mpirun,), agent_pid=77, agent_name=agent_name("mpi")))
    assert v.kind == "agent_teardown" and "by the MPI launcher (pid 77)" in v.summary, v.summary
    # an old signal to the same pid is not this death's
    stale = SignalSent("kill", 4242, 102, 9, 0, int(1 * S))
    assert autopsy(Evidence((victim,), signals=(stale,))).confidence != "certain"
    # the kernel's own SIGKILL (si_code 128) is the OOM killer's business, not a sender's
    kernel = SignalSent("python3", 102, 102, 9, 128, int(9.999 * S))
    oom = KernelOom(102, int(10 * S), "memcg", "/job", "/job", "python3", None, ())
    assert autopsy(Evidence((victim,), kernel=(oom,), signals=(kernel,))).kind == "cgroup_oom"


def test_the_agent_s_own_ending_signal_from_an_oom_daemon_is_that_daemon_s_kill():
    """The tracepoint saw earlyoom SIGTERM the torchrun agent, which then sent the ranks its
    closing signal: the job was ended by the userspace OOM daemon, not from outside by a
    person or a scheduler; a sender that is no OOM daemon is still a signal from outside."""
    from sidecar.autopsy import SignalSent

    victim = _r("1", 102, 15, 10.0)
    by_agent = SignalSent("pt_elastic", 77, 102, 15, 0, int(9.999 * S))
    to_agent = SignalSent("earlyoom", 900, 77, 15, 0, int(9.99 * S))
    v = autopsy(Evidence((victim,), signals=(by_agent, to_agent), agent_pid=77))
    assert (v.kind, v.confidence) == ("userspace_oom", "certain") and "earlyoom" in v.summary, v.summary
    by_kill = SignalSent("kill", 4242, 77, 15, 0, int(9.99 * S))
    v = autopsy(Evidence((victim,), signals=(by_agent, by_kill), agent_pid=77))
    assert v.kind == "external_signal" and v.confidence == "certain", v.summary


def test_a_running_oom_daemon_makes_an_unexplained_kill_only_possible():
    v = autopsy(Evidence((_r("1", 102, 9, 10.0),), oom_daemons=(("earlyoom", 812),)))
    assert v.kind == "external_signal" and v.confidence == "possible"  # never guessed as an OOM
    assert "earlyoom (pid 812)" in v.summary and any(e.source == "proc" for e in v.evidence)


def _rank(label: str, pid: int, code: int | None, died: int | None, cgroup: str = "/job") -> RankState:
    return RankState(label, int(label), int(label), pid, (), code, died, cgroup, None, "connector")


def test_autopsy_userspace_records():
    r0, r1 = _rank("0", 100, 9, 10 * S + 5), _rank("1", 101, 9, 10 * S)
    by_pid = UserspaceKill("earlyoom", 101, None, 9, None, EARLYOOM_18, "log")
    v = autopsy(Evidence((r0, r1), userspace=(by_pid,)))
    assert v is not None and (v.kind, v.confidence, v.victim.pid) == ("userspace_oom", "certain", 101)
    assert v.fates == {"1": "root_cause", "0": "terminated_by_agent"}  # the line names 101 only
    by_cgroup = UserspaceKill("systemd-oomd", None, "/", 9, None, SYSTEMD_OOMD, "xattr")
    v = autopsy(Evidence((r0, r1), userspace=(by_cgroup,)))
    assert v is not None and (v.kind, v.confidence) == ("userspace_oom", "likely")
    assert v.fates == {"1": "root_cause", "0": "same_cause"}
    elsewhere = UserspaceKill("systemd-oomd", None, "/other", 9, None, SYSTEMD_OOMD, "xattr")
    other_pid = UserspaceKill("earlyoom", 555, None, 9, None, EARLYOOM_18, "log")
    v = autopsy(Evidence((r0, r1), userspace=(elsewhere, other_pid)))
    assert v is not None and v.kind == "external_signal"  # never a guess from another's record
    # a SIGSEGV is not what OOM daemons send, even when a record names the cgroup
    v = autopsy(Evidence((_rank("0", 100, 11, S),), userspace=(by_cgroup,)))
    assert v is not None and v.kind == "segfault"
    # the exit's source is told in the first evidence item
    told = autopsy(Evidence((RankState("0", 0, 0, 7, (), 9, S, None, None, "agent-log"),)))
    assert told is not None and told.evidence[0].source == "agent-log"
    assert "from the agent's log" in told.evidence[0].detail


def test_without_first_hand_times_the_agents_teardown_decides_the_root_cause():
    """Both deaths noticed in one sampler round, rank 0 "first": the agent's log says it
    sent rank 0 its closing SIGTERM, so rank 1 is the root cause."""
    r0 = RankState("0", 0, 0, 100, (), 15, 10 * S, "/job", None, "agent-log")
    r1 = RankState("1", 1, 1, 101, (), 9, 10 * S + 1, "/job", None, "agent-log")
    v = autopsy(Evidence((r0, r1), agent_teardown=frozenset({100})))
    assert v is not None and v.victim.pid == 101 and v.kind == "external_signal"
    assert v.fates == {"0": "terminated_by_agent", "1": "root_cause"}
    v = autopsy(Evidence((r0, r1)))
    assert v is not None and v.victim.pid == 100  # without it, the noticed order decides


def test_kernel_records_lost_near_a_death_make_no_record_no_evidence():
    """An overrun of the kernel log near the death: the missing OOM record may be among the
    lost ones, so an unexplained SIGKILL is only possible, and the evidence says why."""
    victim = _r("1", 102, 9, 10.0)
    plain = autopsy(Evidence((victim,)))
    assert (plain.kind, plain.confidence) == ("external_signal", "likely")
    lost = autopsy(Evidence((victim,), kernel_losses=((int(9.5 * S), 37),)))
    assert (lost.kind, lost.confidence) == ("external_signal", "possible"), lost
    assert "37 kernel log records near the death were lost unread" in lost.summary
    assert any(e.source == "kmsg" and "may have been among them" in e.detail for e in lost.evidence)
    far = autopsy(Evidence((victim,), kernel_losses=((int(700 * S), 37),)))  # ten minutes later
    assert far.confidence == "likely"


def test_the_watch_hands_kernel_log_losses_to_the_autopsy(tmp_path):
    from sidecar.deaths.engine import DeathWatch
    from sidecar.deaths.incidents import Generation, Incident, Reads
    from sidecar.postmortem import PostmortemStore
    from sidecar.sampling.timeline import Timeline

    watch = DeathWatch(PostmortemStore(str(tmp_path)), Timeline(60, 1), Gatherer(), hostname="h")
    watch.on_kmsg_loss(12, 5_000_000)  # 12 records lost, 5 s after boot on the printk clock
    inc = Incident(Generation("j", 1, None, 2, 0, None), {})
    ev = watch.autopsies._evidence(inc, Reads.nothing())  # the join the autopsy round makes
    assert ev.kernel_losses == ((5_000_000_000, 12),)


GLOO_TIMEOUT = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 10000ms for recv operation to complete"
)


def _words(label: str, *lines: str) -> tuple:
    from sidecar.parse.ranks import parse_rank_output

    return tuple((label, f) for f in parse_rank_output("\n".join(lines) + "\n"))


@pytest.mark.parametrize(
    "peer_said, cause",
    [
        # its own failure: why it never arrived; the timeout is the consequence
        (
            ("Traceback (most recent call last):", '  File "t.py", line 3, in <module>', "ValueError: bad"),
            "python_exception",
        ),
        (("Fatal Python error: Segmentation fault",), "segfault"),
        # a signal it received (Ctrl-C after the hang), a peer's report: the timeout stays
        (
            ("Traceback (most recent call last):", '  File "t.py", line 3, in <module>', "KeyboardInterrupt"),
            None,
        ),
        (
            (
                "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] "
                "Connection closed by peer [127.0.0.1]:43211",
            ),
            None,
        ),
        ((), None),
    ],
)
def test_a_peer_s_own_failure_is_why_it_never_reached_the_timed_out_collective(peer_said, cause):
    """Rank 0 exited 1 of gloo's timeout; rank 1, still alive (a non-daemon thread holds a
    process after its traceback), never waited in that collective. Where rank 1's own words say
    it failed, that failure is the cause and the timeout its consequence, at most likely (the
    order is the words', no clock's); otherwise the timeout is rank 0's own."""
    output = _words("0", "Traceback (most recent call last):", GLOO_TIMEOUT) + _words("1", *peer_said)
    v = autopsy(Evidence((_r("0", 101, 1 << 8, 10.0), _r("1", 102)), output=output, output_read=True))
    if cause is None:
        assert v.kind == "collective_timeout" and v.victim.label == "0", (v.kind, v.summary)
        return
    assert v.kind == cause and v.victim.label == "1" and v.confidence != "certain", (v.kind, v.summary)
    assert v.fates == {"0": "same_cause", "1": "root_cause"}, v.fates
    assert any("timed out waiting for it" in e.detail for e in v.evidence), v.evidence


PEER_CLOSED = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [127.0.0.1]:35210. This is typically caused by a remote worker crashing."
)


def _exit(label: str, pid: int, code: int, at: float, source: str) -> RankState:
    return RankState(label, int(label), int(label), pid, (), code, int(at * S), "/job", None, source)


@pytest.mark.parametrize("source", ["proc", "agent-log"])
def test_a_rank_that_reports_its_peer_gone_is_not_first_when_the_exits_were_only_noticed(source):
    """Rank 1 is SIGKILLed; rank 0's all_reduce fails with gloo's "Connection closed by
    peer" and it exits 1. Both ends noticed in one round (zombies, the agent's table, whose
    "first observed failure" is rank 0): the times cannot order them, rank 0's words can.
    Rank 1 is the root cause (no word on who killed it); with the kernel's record, the
    cgroup's OOM, certain; rank 0 died of the same cause."""
    ranks = (_exit("0", 100, 1 << 8, 10.0, source), _exit("1", 101, 9, 10.0 + 1e-6, source))
    output = _words("0", "Traceback (most recent call last):", PEER_CLOSED)
    v = autopsy(Evidence(ranks, output=output, output_read=True, exits_first_hand=False))
    assert v is not None and v.victim.pid == 101 and v.kind == "external_signal", (v.kind, v.summary)
    assert v.fates == {"0": "same_cause", "1": "root_cause"}, v.fates
    oom = KernelOom(101, int(9.5 * S), "memcg", "/pod", "/pod/c", "python", 1 << 30, ("oom-kill:...pid=101",))
    v = autopsy(Evidence(ranks, kernel=(oom,), output=output, output_read=True, exits_first_hand=False))
    assert v is not None and (v.victim.pid, v.kind, v.confidence) == (101, "cgroup_oom", "certain"), v.summary


@pytest.mark.parametrize(
    "second, why",
    [
        (_exit("1", 101, 9, 10.001, "connector"), "timed exits: rank 1 died after rank 0's end"),
        (_exit("1", 101, 15, 10.0, "proc"), "a SIGTERM: how the agent's teardown starts"),
        (_exit("1", 101, 9, 40.0, "proc"), "a SIGKILL 30 s later: the teardown's escalation"),
        (_exit("1", 101, 1 << 8, 10.0, "proc"), "an exit of its own, with no words"),
    ],
)
def test_a_report_of_a_peer_gone_keeps_its_rank_first_where_nothing_says_the_other_went_first(second, why):
    """Where the other rank's end is known to come after (timed exits), or is what a
    launcher's teardown does, the peer rank 0 reports is elsewhere (another node): rank 0
    stays the job's first death, its failure a report of a peer's (peer_failure)."""
    first = _exit("0", 100, 1 << 8, 10.0, second.exit_source or "proc")
    output = _words("0", "Traceback (most recent call last):", PEER_CLOSED)
    v = autopsy(Evidence((first, second), output=output, output_read=True))
    assert v is not None and v.victim.pid == 100 and v.facts.peer_failure, (why, v.kind, v.summary)


def test_a_rank_s_own_failure_beside_the_report_keeps_it_first():
    """Rank 0's own words say why it failed (a ValueError) before its peer's end closed the
    connection: a cause, not only a report; the order of the exits decides."""
    ranks = (_exit("0", 100, 1 << 8, 10.0, "proc"), _exit("1", 101, 9, 10.0 + 1e-6, "proc"))
    output = _words(
        "0", "Traceback (most recent call last):", '  File "t.py", line 3, in <module>', "ValueError: bad"
    ) + _words("0", "Traceback (most recent call last):", PEER_CLOSED)
    v = autopsy(Evidence(ranks, output=output, output_read=True))
    assert v is not None and v.victim.pid == 100 and v.kind == "python_exception", (v.kind, v.summary)
