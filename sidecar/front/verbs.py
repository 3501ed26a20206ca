"""The verbs of the command line, declared once: each one's name, one-line summary, the
parser of its options (built from the option table, ``options.OPTIONS``, where it shares the
daemon's options) and the function that does it.

The parsers import nothing but argparse and the option table, so building one starts
nothing: ``trainwatch VERB --help`` prints usage and exits 0 for every verb, and the man page
and the shell completions (``manual.py``) are generated from these same parsers, at build
time and by ``trainwatch completion``. ``cli.py`` runs the verb.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.front.options import DOCTOR, RUN, StrictParser, add_options, build_parser

__all__ = ["VERBS", "Verb", "listing", "parser_for"]

RAW = argparse.RawDescriptionHelpFormatter

RUN_HELP = """\
Start COMMAND (torchrun, deepspeed, mpirun, srun, a script that starts its ranks) and watch
only that job: the same HTTP (/metrics, /ranks, /postmortem) and postmortems as the daemon.
(srun's tasks are slurmd's: run knows its own step by TRAINWATCH_RUN_OUTPUT.) Its output and
its ranks' output pass through unchanged and the last 8 MiB are kept as evidence, also in
<postmortem dir>/spool/run-PID.out (named in the job's environment as TRAINWATCH_RUN_OUTPUT),
where a trainwatch daemon watching the node reads it too. Signals sent to trainwatch are
passed on; Ctrl-C at a terminal reaches COMMAND directly.

The options are the daemon's (trainwatch --help) but --attach-torchrun and --pid.
trainwatch's own log is at WARNING unless --log-level says otherwise; the port is 9864, or a
free one when that is taken and neither --port nor TRAINWATCH_PORT was given.

  trainwatch run -- torchrun --nproc-per-node=4 train.py
  trainwatch run --port 0 --postmortem-dir ./pm -- torchrun --standalone --nproc-per-node=2 train.py
  trainwatch run --end-stranded-after 2m -- srun --ntasks=8 python train.py

Exit status: COMMAND's (128+N after signal N); 124 when --end-stranded-after ended the job;
2 on a bad option."""

DIAGNOSE_HELP = """\
Name what killed a training job from its logs, after the fact.

Give any mix of files and standard input (-): the torchrun output (any torch version's
agent lines and failure table, the ranks' tracebacks and NCCL/gloo messages, DeepSpeed's or
accelerate's launcher), the kernel log (dmesg, dmesg -T, journalctl -k, kern.log), Slurm,
Kubernetes, Docker or Ray messages, earlyoom/systemd-oomd journal lines. What each file is
comes from its content. The answer is the same postmortem document the daemon writes, with
what the logs cannot tell set to null; when they cannot decide, it says so and lists what to
collect next time.

  dmesg -T | trainwatch diagnose - train.log
  trainwatch diagnose --format json slurm-1234.out kern.log

Exit status 0 when it ran (also when the answer is "unknown"), 2 when an input cannot be read.
"""

STORY_HELP = """\
Tell one job's death across nodes: which rank on which node died first and of what, what
every other rank on every node did after it, in order, and what could not be seen.

Every node's daemon exports its deaths (trainwatch_rank_death_timestamp_seconds, with the
instance Prometheus scrapes it at); the story asks Prometheus which nodes saw the job die,
reads each node's postmortems from its daemon, bounds each node's clock against
Prometheus's from the scrapes, and joins them (schema trainwatch.story/v1). A daemon
started with --prometheus URL serves the same at GET /story?job=RUN_ID.

  trainwatch story --prometheus http://prometheus:9090
  trainwatch story --prometheus http://prometheus:9090 --job 4711 --format html > story.html

Exit status 0 with a story, 2 with a one-line error (Prometheus cannot be asked, no death
of the job in the window, a bad option).
"""

POSTMORTEM_HELP = """\
Print a postmortem in the terminal: by id (from the postmortem directory), from a .json
file, or from a daemon's URL. Without an argument: the newest in the postmortem directory,
else the newest that the local daemon serves (--host, --port, as the daemon's).

  trainwatch postmortem
  trainwatch postmortem 20261205T070035Z-node-17040-r1 --format json
  trainwatch postmortem http://node-17:9864

Exit status 0 with a postmortem, 2 when there is none or it cannot be read."""

DOCTOR_HELP = """\
Say which evidence sources this machine offers the daemon that these options describe (the
same options and TRAINWATCH_* variables as the daemon's), what is lost without each missing
one and how to get it back; also whether the emitter catalog loads whole, the postmortem
directory is writable and the web config loads. A source turned off by --disable is not
missing.

  trainwatch doctor
  TRAINWATCH_DISABLE=tracepoint trainwatch doctor --strict

Exit status 0; with --strict, 1 when a source the options rely on is missing; 2 on a bad option."""

DEMO_HELP = """\
Run a small real torchrun job (gloo, CPU; needs torch) in which rank 1 grows past a 1.5 GiB
memory cgroup limit that the demo creates (as root; otherwise it kills rank 1 from outside
and says why), with the daemon attached; print the postmortem and where its HTML view is.
Takes about a minute. Exit status 0 when a postmortem was written."""

COMPLETION_HELP = """\
Print the shell completion script for trainwatch's verbs and options, generated from its
parsers.

  source <(trainwatch completion bash)                     # this shell
  trainwatch completion bash > /etc/bash_completion.d/trainwatch
  trainwatch completion zsh > "${fpath[1]}/_trainwatch\""""


def _daemon() -> argparse.ArgumentParser:
    return build_parser()


def _run() -> argparse.ArgumentParser:
    p = StrictParser(
        prog="trainwatch run",
        usage="trainwatch run [options] -- COMMAND [ARGS...]",
        description=RUN_HELP,
        formatter_class=RAW,
    )
    add_options(p, RUN)
    return p


def _diagnose() -> argparse.ArgumentParser:
    p = StrictParser(prog="trainwatch diagnose", description=DIAGNOSE_HELP, formatter_class=RAW)
    p.add_argument(
        "files", nargs="*", metavar="FILE", help="a log file, or - for standard input (the default)"
    )
    p.add_argument("--format", choices=("text", "json", "html"), default="text", help="(default text)")
    return p


def _postmortem() -> argparse.ArgumentParser:
    p = StrictParser(prog="trainwatch postmortem", description=POSTMORTEM_HELP, formatter_class=RAW)
    p.add_argument(
        "what", nargs="?", help="a postmortem id, a .json file, or a URL (http://host:port[/postmortem...])"
    )
    p.add_argument("--format", choices=("text", "json"), default="text", help="(default text)")
    add_options(p, "postmortem")
    return p


def _story() -> argparse.ArgumentParser:
    p = StrictParser(prog="trainwatch story", description=STORY_HELP, formatter_class=RAW)
    add_options(p, "story")
    p.add_argument(
        "--job",
        metavar="RUN_ID",
        help="the job's run id, its job label (default: the newest job with a death)",
    )
    p.add_argument("--format", choices=("text", "json", "html"), default="text", help="(default text)")
    p.add_argument(
        "--window", metavar="DURATION", default="1d", help="how far back to look: 30m, 6h, 7d (default 1d)"
    )
    p.add_argument("--timeout", metavar="SECONDS", default="3", help="per request to a node (default 3)")
    return p


def _doctor() -> argparse.ArgumentParser:
    p = StrictParser(prog="trainwatch doctor", description=DOCTOR_HELP, formatter_class=RAW)
    add_options(p, DOCTOR)
    p.add_argument(
        "--strict", action="store_true", help="exit 1 when a source the options rely on is missing"
    )
    return p


def _demo() -> argparse.ArgumentParser:
    return StrictParser(prog="trainwatch demo", description=DEMO_HELP, formatter_class=RAW)


def _completion() -> argparse.ArgumentParser:
    p = StrictParser(prog="trainwatch completion", description=COMPLETION_HELP, formatter_class=RAW)
    p.add_argument("shell", choices=("bash", "zsh"), help="the shell")
    return p


@dataclass(frozen=True, slots=True)
class Verb:
    name: str  # "" is the daemon itself (trainwatch --attach-torchrun)
    summary: str
    parser: Callable[[], argparse.ArgumentParser]
    handler: str  # "module:function", imported only when the verb runs


VERBS: tuple[Verb, ...] = (
    Verb(
        "",
        "the daemon: watch every training job on this machine, serve /metrics and /postmortem",
        _daemon,
        "sidecar.front.cli:daemon_command",
    ),
    Verb(
        "run", "start a job and watch it: trainwatch run -- torchrun ...", _run, "sidecar.front.cli:run_verb"
    ),
    Verb(
        "diagnose",
        "name the killer from logs after the fact",
        _diagnose,
        "sidecar.front.cli:diagnose_command",
    ),
    Verb(
        "postmortem",
        "print a postmortem (newest, by id, file or URL)",
        _postmortem,
        "sidecar.front.cli:postmortem_command",
    ),
    Verb(
        "story", "one job's death across nodes, through Prometheus", _story, "sidecar.front.cli:story_command"
    ),
    Verb(
        "doctor",
        "which evidence sources this machine offers, and how to get the rest",
        _doctor,
        "sidecar.front.cli:doctor_command",
    ),
    Verb(
        "demo",
        "a real torchrun job dies at a memory limit; read its postmortem",
        _demo,
        "sidecar.front.cli:demo_command",
    ),
    Verb(
        "completion",
        "print the bash or zsh completion script",
        _completion,
        "sidecar.front.cli:completion_command",
    ),
)


def parser_for(name: str) -> argparse.ArgumentParser:
    """The parser of a verb ("" for the daemon)."""
    for v in VERBS:
        if v.name == name:
            return v.parser()
    raise KeyError(name)


def listing() -> str:
    """What ``trainwatch`` alone and ``trainwatch help`` print."""
    rows = [("trainwatch --attach-torchrun", VERBS[0].summary)]
    rows += [(f"trainwatch {v.name}", v.summary) for v in VERBS[1:]]
    width = max(len(a) for a, _ in rows)
    return (
        "usage: trainwatch --attach-torchrun [options] | trainwatch VERB [options]\n\n"
        + "\n".join(f"  {a:<{width}}  {b}" for a, b in rows)
        + "\n\ntrainwatch VERB --help (trainwatch --help for the daemon) says more; "
        "trainwatch --version prints the version.\n"
    )
