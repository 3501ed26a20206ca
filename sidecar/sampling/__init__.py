"""The sampling flow: find, read, judge, publish.

- find: ``discovery`` finds torchrun agents, their ranks and the ranks' trees.
- read: ``sampler`` reads every probe into one ``Snapshot`` per round.
- judge: ``foresight`` (time left before each memory limit) and ``stalls`` (who holds a
  collective up) put their judgements on the snapshot.
- publish: ``timeline`` keeps each job's history for the postmortem's curves; the snapshot
  itself is published by ``sidecar.metrics`` and ``sidecar.web.server``.
"""
