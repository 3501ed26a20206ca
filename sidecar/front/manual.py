"""The man page, the shell completions and docs/options.md, generated from the verbs' own
parsers (``verbs.VERBS``) and the option table, so they cannot drift from what the command
accepts.

``python -m sidecar.front.manual DIR`` writes ``trainwatch.1``, ``trainwatch.bash`` and
``_trainwatch`` (zsh) into DIR: the wheel's build runs it (``setup.py``) and carries them in
``sidecar/share/``; ``trainwatch completion bash|zsh`` prints the completions;
``python -m sidecar.front.manual --options`` prints docs/options.md. Only argparse and the option
table are imported: the build environment has nothing else.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from sidecar import __version__
from sidecar.front.options import DAEMON, DOCTOR, OPTIONS, POSTMORTEM, RUN, STORY
from sidecar.front.verbs import VERBS, Verb
from sidecar.settings import EVIDENCE_SOURCES

__all__ = ["completion", "man_page", "render_options", "write"]


def _roff(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("-", "\\-")
    return "\n".join(("\\&" + line) if line.startswith((".", "'")) else line for line in text.splitlines())


def _usage(v: Verb, p: argparse.ArgumentParser) -> str:
    return re.sub(r"\s+", " ", p.format_usage().removeprefix("usage: ")).strip()


def man_page() -> str:
    """trainwatch(1) in roff."""
    out = [
        f'.TH TRAINWATCH 1 "" "trainwatch {__version__}" "User Commands"',
        ".SH NAME",
        "trainwatch \\- name what killed a rank of a distributed PyTorch training job",
        ".SH SYNOPSIS",
    ]
    for v in VERBS:
        out += [".nf", _roff(_usage(v, v.parser())), ".fi"]
    out += [".SH DESCRIPTION", _roff(VERBS[0].parser().description or "")]
    for v in VERBS:
        p = v.parser()
        out += [".SH " + ("THE DAEMON" if not v.name else f"TRAINWATCH {v.name.upper()}"), _roff(v.summary)]
        if v.name and p.description:
            out += [".PP", ".nf", _roff(p.description), ".fi"]
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action.metavar, tuple):
                continue
            names = ", ".join(action.option_strings) or (action.metavar or action.dest)
            takes_value = action.nargs != 0 and not isinstance(action, argparse._VersionAction)
            if action.option_strings and takes_value:
                names += f" {action.metavar or action.dest.upper()}"
            out += [".TP", f"\\fB{_roff(str(names))}\\fR", _roff(action.help or "")]
    out += [
        ".SH EXIT STATUS",
        "0 done; 1 a failure at run time (doctor \\-\\-strict: a source missing); 2 a bad option or input.",
        ".SH SEE ALSO",
        "The documentation in the source tree: README.md and docs/.",
    ]
    return "\n".join(out) + "\n"


def _words(p: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]]]:
    """A parser's flags, and for those with a fixed set of values (or positionals), the values."""
    flags: list[str] = []
    values: dict[str, list[str]] = {}
    for action in p._actions:
        flags += action.option_strings
        if action.choices:
            for name in action.option_strings or [""]:
                values[name] = [str(c) for c in action.choices]
    return flags, values


def completion(shell: str) -> str:
    """The completion script for ``shell`` (bash or zsh)."""
    verbs = [v.name for v in VERBS if v.name]
    if shell == "bash":
        cases = []
        for v in VERBS:
            flags, values = _words(v.parser())
            pos = " ".join(values.get("", []))
            value_cases = "".join(
                f"      {flag}) COMPREPLY=($(compgen -W '{' '.join(vals)}' -- \"$cur\")); return;;\n"
                for flag, vals in values.items()
                if flag
            )
            cases.append(
                f"    {v.name or '__daemon'})\n"
                f'      case "$prev" in\n{value_cases}      esac\n'
                f"      COMPREPLY=($(compgen -W '{' '.join(flags)} {pos}' -- \"$cur\"));;\n"
            )
        return (
            f"# bash completion for trainwatch {__version__} (generated from its parsers)\n"
            "_trainwatch() {\n"
            '  local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"\n'
            '  local verb="${COMP_WORDS[1]}"\n'
            '  if [ "$COMP_CWORD" -eq 1 ]; then\n'
            f"    COMPREPLY=($(compgen -W '{' '.join(verbs)} help {' '.join(_words(VERBS[0].parser())[0])}'"
            ' -- "$cur")); return\n'
            "  fi\n"
            f'  case " {" ".join(verbs)} " in *" $verb "*) ;; *) verb=__daemon;; esac\n'
            '  case "$verb" in\n' + "".join(cases) + "  esac\n}\n"
            "complete -o default -F _trainwatch trainwatch\n"
        )
    if shell == "zsh":
        lines = [
            "#compdef trainwatch",
            f"# zsh completion for trainwatch {__version__} (generated from its parsers)",
            "_trainwatch() {",
            "  local -a verbs",
            "  verbs=("
            + " ".join(f"'{v.name}:{v.summary.replace(chr(39), '')}'" for v in VERBS if v.name)
            + ")",
            "  if (( CURRENT == 2 )); then",
            "    _describe 'verb' verbs",
            "    _arguments " + " ".join(f"'{f}'" for f in _words(VERBS[0].parser())[0]),
            "    return",
            "  fi",
            "  case $words[2] in",
        ]
        for v in VERBS[1:]:
            flags, values = _words(v.parser())
            specs = []
            for f in flags:
                vals = values.get(f)
                specs.append(f"'{f}:value:({' '.join(vals)})'" if vals else f"'{f}'")
            if values.get(""):
                specs.append(f"'1:value:({' '.join(values[''])})'")
            specs.append("'*:file:_files'")
            lines.append(f"    {v.name}) _arguments {' '.join(specs)};;")
        flags = _words(VERBS[0].parser())[0]
        lines += [
            f"    *) _arguments {' '.join(repr(f) for f in flags)};;",
            "  esac",
            "}",
            '_trainwatch "$@"',
        ]
        return "\n".join(lines) + "\n"
    raise ValueError(f"no completion for {shell!r}: bash or zsh")


def render_options() -> str:
    """docs/options.md: the option table (``options.OPTIONS``) as a page."""
    lines = [
        "# Options",
        "",
        "<!-- Generated from sidecar/front/options.py (OPTIONS) by",
        "     `python -m sidecar.front.manual --options > docs/options.md`;",
        "     tests/unit/front/test_front_door.py checks it is current. Do not edit by hand. -->",
        "",
        "The daemon's options (`trainwatch --attach-torchrun [options]`). Each has an environment",
        "variable; an option wins over its variable. `trainwatch run` takes the same options except",
        "`--attach-torchrun` and `--pid`; `trainwatch doctor` takes them all but `--attach-torchrun` and",
        "checks this machine for the daemon they describe. A bad value is one line naming the option",
        "or the variable that gave it, and exit status 2.",
        "",
        "| option | variable | default | what it does | verbs |",
        "| --- | --- | --- | --- | --- |",
    ]
    for o in OPTIONS:
        flag = f"`{o.flag}`" if o.flag else "(variable only)"
        if o.flag and o.metavar:
            flag = f"`{o.flag} {o.metavar}`"
        if o.off_flag:
            flag += f", `{o.off_flag}`"
        verbs = ", ".join(
            v if v != DAEMON else "the daemon"
            for v in (DAEMON, RUN, DOCTOR, POSTMORTEM, STORY)
            if v in o.verbs
        )
        var = f"`{o.var}`" + ("=1/0" if o.switch else "")
        help_text = o.help + (f"; {o.off_flag}: {o.off_help}" if o.off_flag else "")
        lines.append(f"| {flag} | {var} | {o.default} | {help_text} | {verbs} |")
    lines += [
        "",
        "Evidence sources that `--disable` turns off:",
        "",
        "| source | what it is |",
        "| --- | --- |",
        *(f"| `{name}` | {what} |" for name, what in EVIDENCE_SOURCES.items()),
        "",
    ]
    return "\n".join(lines)


def write(directory: str | Path) -> list[Path]:
    """Write the man page and both completions into ``directory``; the paths written."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = {
        "trainwatch.1": man_page(),
        "trainwatch.bash": completion("bash"),
        "_trainwatch": completion("zsh"),
    }
    for name, text in files.items():
        (d / name).write_text(text, encoding="utf-8")
    return [d / name for name in files]


if __name__ == "__main__":
    if sys.argv[1:] == ["--options"]:
        sys.stdout.write(render_options())
    else:
        for path in write(sys.argv[1] if len(sys.argv) > 1 else "."):
            print(path)
