"""The Celery face of the pipeline: the app, the inference task and the worker bootstep
that runs the dispatcher. ``celery -A tasks worker`` starts a complete worker node."""

from __future__ import annotations

from . import node  # noqa: F401  (registers the bootstep and signal handlers)
from .app import app
from .inference import infer

__all__ = ["app", "infer"]
