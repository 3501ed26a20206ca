"""Diagnose after the fact: the daemon's verdict from logs alone (``trainwatch diagnose``).

Every input is read whole (the last ``MAX_BYTES`` of a bigger file) and every parser runs
on all of it, so a file's kind comes from what it holds, not its name, and a file that
mixes the agent's lines, the ranks' tracebacks and a pasted ``dmesg`` is read for all
three. From the records:

* the ranks: the agent's failure table and ``failed (exitcode: N)`` line, its closing
  signals (those ranks it tore down), DeepSpeed's and other launchers' exit lines, a
  shell's ``8156 Killed``; ranks a ``[rankN]:`` line names; torn-down pids get the local
  rank their place in a run of consecutive pids gives, said as inferred;
* the kernel's OOM records (any timestamp style, wrapped lines joined), its task table
  (each rank's RSS), ``N pages RAM``, NVRM Xids; schedulers', containers', Ray's and
  userspace OOM daemons' records.

The pid is the link: a kernel record naming a rank's pid is that rank's death, whatever
the clocks say. Then the daemon's path: the same autopsy, the rules for logs on top
(``autopsy.logs``), the same advice and the same document builder.

The package, one job a module: ``inputs`` reads the files, ``contents`` runs every parser
on them, ``ranks`` and ``kernel`` make the ranks and the kernel's records of what they
found, ``verdict`` the evidence and the autopsy, ``document`` the postmortem.
"""

from sidecar.diagnose.document import diagnose
from sidecar.diagnose.inputs import DiagnoseError, LogInput, read_inputs

__all__ = ["DiagnoseError", "LogInput", "diagnose", "read_inputs"]
