"""What an attempt reports, and the copies of its outcome its finish / requeue writes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from ..observability.logs import log_bodies
from ..store import Mirror


class Mirrors(Protocol):
    """The Celery result of the attempt's task (built by ``tasks``); None: not mirrored."""

    def success(self) -> Mirror | None: ...

    def failure(self, message: str) -> Mirror | None: ...

    def retry(self, reason: str) -> Mirror | None: ...

    def written(self, state: str) -> None:
        """The attempt's finish / requeue wrote its mirror of ``state`` (Celery's own store of
        that state is then skipped)."""


def failure_message(
    status_code: int | None, payload: str, error_code: str | None, error_message: str | None
) -> str:
    """What a failed request reports to Flower and the log: its code and the pipeline's
    message, never a response body (user data) unless ``PIPELINE_LOG_BODIES=1``."""
    if error_code:
        return f"{error_code}: {error_message or ''}"[:500]
    if log_bodies():
        return f"HTTP {status_code}: {payload or ''}"[:500]
    note = f"; {error_message}" if error_message else ""  # e.g. the gateway's drop reason
    return f"HTTP {status_code} ({len(payload.encode())}-byte response body){note}"[:500]


class Status(enum.Enum):
    STALE = "stale"  # the message was fenced off (old token, cancelled, finished)
    ABORTED = "aborted"  # cancelled with running="abort": the cancel wrote the result
    SUCCESS = "success"
    FAILED = "failed"  # terminal, not OK
    RETRY = "retry"  # an attempt failed and the request waits out a backoff
    REQUEUED = "requeued"  # the gate refused or a wait timed out: back to the queue


@dataclass(frozen=True)
class Report:
    status: Status
    reason: str = ""  # RETRY/REQUEUED: why; FAILED: the failure message
    due: float | None = None  # Unix s, for RETRY/REQUEUED
    result: dict[str, Any] | None = None  # the terminal result, for SUCCESS/FAILED
