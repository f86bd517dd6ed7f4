"""The client API: submit requests, read their state and results, cancel, inspect."""

from ..store.state import ordering_score
from .api import CANCEL_RUNNING, Pipeline, Request, canceller, configure, default_pipeline
from .explain import Explanation
from .models import Result

__all__ = [
    "CANCEL_RUNNING",
    "Explanation",
    "Pipeline",
    "Request",
    "Result",
    "canceller",
    "configure",
    "default_pipeline",
    "ordering_score",
]
