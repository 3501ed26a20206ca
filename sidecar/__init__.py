"""trainwatch: a sidecar daemon for distributed PyTorch training.

It finds torchrun agents and their worker ranks, samples each rank's host memory (with
its DataLoader workers), GPU memory and the memory cgroups around it, and exports all of
it in Prometheus format. The import package is ``sidecar``; the console script is
``trainwatch``.
"""

# The one place the version is written: pyproject.toml reads it (tool.setuptools.dynamic),
# and everything else imports it.
__version__ = "0.4.0.dev0"

__all__ = ["__version__"]
