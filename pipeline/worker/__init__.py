"""The worker side of an attempt, independent of Celery (``tasks`` is its thin Celery face)."""

from .attempt import Attempt
from .endpoints import check_endpoints
from .identity import AttemptId, Hooks
from .process import Runtime, runtime
from .report import Report, Status

__all__ = [
    "Attempt",
    "AttemptId",
    "Hooks",
    "Report",
    "check_endpoints",
    "Runtime",
    "Status",
    "runtime",
]
