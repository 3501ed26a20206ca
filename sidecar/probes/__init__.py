"""One module per thing read: ``proc`` (/proc/PID/*), ``cgroup``, ``host``, ``gpu`` (NVML).

Each module has pure parsers (text in, dataclass out) and readers that take the root
they read from (``/proc``, the mount table) as a parameter, so tests point them at
fixture trees.
"""
