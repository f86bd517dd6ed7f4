"""The dispatcher (one per worker node, main process): moves the head of each queue into
Celery as free slots and gate budgets allow, registers the node's slots and runs the reaper.
Imports ``config``, ``store``, ``gates``, ``observability`` and ``errors`` of the pipeline."""

from .dispatcher import Dispatcher

__all__ = ["Dispatcher"]
