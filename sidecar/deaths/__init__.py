"""A death's flow: hear, gather, decide, write, remember.

- hear: ``engine.DeathWatch.observe`` and its feeds (exits, signals, the kernel's records in
  ``records``) note that a watched process ended and queue it; nothing is read there.
- gather: ``gather.Gatherer``, the one door for reads after a death, on the worker thread.
- decide: ``incidents`` joins reads and records into the autopsy's ``Evidence``; the verdict
  is the autopsy's (``sidecar.autopsy``).
- write: ``engine`` builds the postmortem (``sidecar.postmortem``) and rewrites it while
  later deaths of the same incident arrive.
- remember: ``journal`` keeps the watch's state on disk; ``reconstruct`` judges, after a
  restart, the deaths that happened while the daemon was down.
"""
