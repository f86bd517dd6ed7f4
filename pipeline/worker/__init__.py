"""The worker side of an attempt, independent of Celery (``tasks`` is the thin Celery face):
the per-process runtime (:mod:`.process`: starts attempts, releases and hands over
reservations, renews leases), the :mod:`.attempt` itself, the release bell that wakes
attempts parked for a slot (:mod:`.bell`), what an attempt reports (:mod:`.report`), its
metrics and traces (:mod:`.observe`) and a queue's endpoint credentials
(:mod:`.endpoints`). Imports ``config``, ``store``, ``gates``, ``http``, ``observability`` and
``errors`` of the pipeline."""

from .attempt import Attempt
from .endpoints import check_endpoints
from .process import Runtime, runtime, use_settings
from .report import Report, Status

__all__ = ["Attempt", "Report", "check_endpoints", "Runtime", "Status", "runtime", "use_settings"]
