"""The ``pipeline`` command (:mod:`.main`) and the local services it starts for the demo — an
embedded Redis, the simulator, a worker (:mod:`.services`). The top of the import graph: may
import every other package of the pipeline, and ``tasks``."""

from .main import main

__all__ = ["main"]
