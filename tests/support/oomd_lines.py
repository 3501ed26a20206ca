"""Userspace OOM daemons' real lines: a real earlyoom's output, systemd-oomd's and oomd's."""

from __future__ import annotations

# printed by the real earlyoom 1.7 binary here (--dryrun); the newer form as earlyoom 1.8
# writes it (oom_score, cmdline)
EARLYOOM_17 = 'sending SIGTERM to process 1137 uid 0 "bash": badness 666, VmRSS 4 MiB'
EARLYOOM_18 = (
    'sending SIGKILL to process 4242 uid 1000 "python": oom_score 1000, VmRSS 20480 MiB, '
    'cmdline "/usr/bin/python train.py --lr 1e-4"'
)
SYSTEMD_OOMD = (
    "Killed /user.slice/user-1000.slice/user@1000.service/app.slice/train.scope due to memory "
    "pressure for /user.slice/user-1000.slice/user@1000.service being 52.34% > 50.00% for > 20s "
    "with reclaim activity"
)
OOMD = (
    "oomd kill: 81.28 80.05 42.78 workload.slice/train.service 1000 ruleset:[protect host] detector:pressure"
)
