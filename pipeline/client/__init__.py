"""The client API: submit requests, read their state and results, cancel, inspect."""

from ..store.state import ordering_score
from .api import Pipeline, Request, configure, default_pipeline
from .explain import Explanation
from .models import Result

__all__ = [
    "Explanation",
    "Pipeline",
    "Request",
    "Result",
    "configure",
    "default_pipeline",
    "ordering_score",
]
