"""The build's one step beyond pyproject.toml: the man page and the shell completions are
generated from the command's own parsers (``sidecar/front/manual.py``) while the wheel is built,
and carried in it as ``sidecar/share/trainwatch.1``, ``trainwatch.bash`` and ``_trainwatch``.
Everything else about the package is declared in pyproject.toml."""

from __future__ import annotations

import importlib
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithManual(build_py):
    def run(self) -> None:
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.insert(0, here)  # the tree being built, not an installed copy
        try:
            manual = importlib.import_module("sidecar.front.manual")
            for path in manual.write(os.path.join(self.build_lib, "sidecar", "share")):
                self.announce(f"generated {path}", level=2)
        finally:
            sys.path.remove(here)


setup(cmdclass={"build_py": BuildWithManual})
