"""The one fold of kernel OOM records (sidecar/autopsy/oom.py), on the records of real kernels."""

from __future__ import annotations

from sidecar.autopsy.oom import WINDOW_NS, OomFold
from sidecar.parse.kernel import parse_oom_line

S = 10**9
SUMMARY = (
    "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/probe_oom,task_memcg=/probe_oom/job,task=python3,pid=8366,uid=0"
)
KILL = (
    "Memory cgroup out of memory: Killed process 8366 (python3) total-vm:119004kB, "
    "anon-rss:102016kB, file-rss:6600kB, shmem-rss:0kB, UID:0 pgtables:268kB oom_score_adj:0"
)
# Linux 4.19 to 5.0: the cgroup whose limit was hit comes in a line of its own, ahead of the kill
LIMIT_4_19 = "Task in /slurm/uid_0/job_7/step_0 killed as a result of limit of /slurm/uid_0/job_7"
KILL_4_19 = (
    "Memory cgroup out of memory: Killed process 4242 (python) total-vm:9000000kB, "
    "anon-rss:8000000kB, file-rss:1000kB, shmem-rss:0kB"
)


def _feed(fold: OomFold, text: str, at_ns: int):
    parsed = parse_oom_line(text)
    assert parsed is not None, text
    return fold.feed(parsed, text, at_ns)


def test_the_summary_and_the_kill_line_of_one_pid_are_one_kill():
    fold = OomFold()
    _feed(fold, SUMMARY, 10 * S)
    merged = _feed(fold, KILL, 10 * S + 37_000)
    (kill,) = fold.kills
    assert kill == merged
    assert (kill.pid, kill.scope, kill.oom_memcg, kill.task_memcg) == (
        8366,
        "memcg",
        "/probe_oom",
        "/probe_oom/job",
    )
    assert kill.rss_bytes == (102016 + 6600) * 1024 and kill.at_ns == 10 * S and len(kill.lines) == 2


def test_records_of_one_pid_far_apart_are_two_kills():
    fold = OomFold()
    _feed(fold, SUMMARY, 10 * S)
    _feed(fold, KILL, 10 * S + WINDOW_NS + 1)
    assert [k.rss_bytes for k in fold.kills] == [None, (102016 + 6600) * 1024]


def test_the_pre_5_0_limit_line_names_the_cgroup_of_the_kill_that_follows():
    fold = OomFold()
    assert _feed(fold, LIMIT_4_19, 10 * S) is None
    kill = _feed(fold, KILL_4_19, 10 * S + 1000)
    assert kill is not None and kill.oom_memcg == "/slurm/uid_0/job_7"
    later = OomFold()
    _feed(later, LIMIT_4_19, 10 * S)
    stale = _feed(later, KILL_4_19, 10 * S + WINDOW_NS)
    assert stale is not None and stale.oom_memcg is None  # a limit line from another kill


def test_logs_without_times_merge_by_pid_in_their_order():
    fold = OomFold()
    for text in (SUMMARY, KILL):
        _feed(fold, text, 0)
    (kill,) = fold.kills
    assert kill.oom_memcg == "/probe_oom" and kill.rss_bytes is not None


def test_the_fold_keeps_the_newest_kills_only():
    fold = OomFold(maxlen=2)
    for i, pid in enumerate((1, 2, 3)):
        _feed(fold, KILL.replace("8366", str(pid)), i * 10 * S)
    assert [k.pid for k in fold.kills] == [2, 3]
