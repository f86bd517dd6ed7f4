"""The dispatcher: one per worker node (:mod:`.dispatcher`)."""

from .dispatcher import Dispatcher

__all__ = ["Dispatcher"]
