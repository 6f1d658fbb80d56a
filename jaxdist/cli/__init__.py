"""The `jaxdist` command line: the one part of jaxdist that wires models/ and meshes/ in."""

from jaxdist.cli.main import main

__all__ = ["main"]
