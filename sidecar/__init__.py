"""trainwatch: a sidecar daemon for torchrun jobs.

It finds torchrun agents and their worker ranks, samples each rank's host memory (with
its DataLoader workers), GPU memory and the memory cgroups around it, and exports all of
it in Prometheus format. The import package is ``sidecar``; the console script is
``trainwatch``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
