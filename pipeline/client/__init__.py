"""The client API: submit requests, read their state and results, cancel, inspect
(:mod:`.api`) and the public value types (:mod:`.models`). Imports ``config``, ``store``,
``gates`` and ``errors`` of the pipeline."""

from .api import Pipeline, configure, default_pipeline, ordering_score
from .explain import Explanation
from .models import Request, Result

__all__ = [
    "Explanation",
    "Pipeline",
    "Request",
    "Result",
    "configure",
    "default_pipeline",
    "ordering_score",
]
