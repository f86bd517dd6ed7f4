"""The ``pipeline`` command and the local services it starts for the demo; the top of the
import graph (it may import every package, and ``tasks``)."""

from .main import main

__all__ = ["main"]
