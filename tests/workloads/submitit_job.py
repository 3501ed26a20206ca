"""A job submitit runs past its time limit (tests/e2e/test_diagnose.py): submitit's local
executor starts this process's ``work`` with a time limit of a few seconds and sends its
warning signal (SIGUSR2) before it; ``work`` is not checkpointable, so submitit's own
handler ends it ("Job not requeued because: timed-out and not checkpointable.").

    python submitit_job.py FOLDER   prints the job's stdout and stderr paths, one a line
"""

from __future__ import annotations

import contextlib
import sys
import time


def work() -> None:
    print("training", flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the signal arrives long before
        time.sleep(0.1)


def main() -> int:
    import submitit

    executor = submitit.LocalExecutor(folder=sys.argv[1])
    # 0.1 min: the limit is 6 s; submitit's signal comes 3 s before it
    executor.update_parameters(timeout_min=0.1, signal_delay_s=3)
    job = executor.submit(work)
    with contextlib.suppress(Exception):  # the job's failure is what the test reads, from its logs
        job.result()
    print(job.paths.stdout)
    print(job.paths.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
