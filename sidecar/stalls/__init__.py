"""Progress: ranks that stopped making it, before and after a death. The one wing of the
live engine that starts a subprocess (py-spy, for a stalled rank's stacks) or writes to a
job (its flight recorder's FIFO), on its own threads; sampling stays read-only.

- ``tracker``: each round, every rank working, idle, in a collective or waiting; a job's
  stall and its suspects.
- ``stacks``: what a stalled rank is doing (py-spy, the flight recorder's dump).
- ``stranded``: the survivors a death left spinning with no progress.
"""
