"""An asynchronous, leak-proof, deadline-ordered LLM inference pipeline on Celery and Redis.

import pipeline
req = pipeline.submit({"model": "m", "prompt": "Hello"}, timeout=600, priority=5)
print(req.result(timeout=60).json())
"""

from __future__ import annotations

from typing import Any

from .batch import Batch, Batches, IngestFailed, UnknownBatch
from .client import Explanation, Pipeline, Request, Result, configure, default_pipeline
from .config import QueueConfig, Settings, load_settings
from .errors import (
    ConfigError,
    IdempotencyConflict,
    InvalidRequest,
    PipelineError,
    ReplicationError,
    StateLost,
    StoreFull,
    UnknownRequest,
    UnsafeRedis,
)

__version__ = "0.1.0"


def submit(
    payload: dict[str, Any],
    *,
    queue: str = "default",
    id: str | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
    metadata: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    endpoint: str | None = None,
) -> Request:
    """Submit one request; returns its handle at once.

    ``payload`` is the JSON body sent as is. ``deadline`` is absolute (Unix s), ``timeout`` is
    relative (s); give at most one (default: the queue's ``default_timeout_s``). ``priority``
    0-9, higher first. ``id`` is an idempotency key: a live id returns the live request.
    Raises :class:`InvalidRequest` naming the bad field, :class:`ReplicationError` when
    ``PIPELINE_REDIS_MIN_REPLICAS`` replicas did not confirm the write in time.
    """
    return default_pipeline().submit(
        payload,
        queue=queue,
        id=id,
        priority=priority,
        deadline=deadline,
        timeout=timeout,
        metadata=metadata,
        headers=headers,
        endpoint=endpoint,
    )


def submit_many(items: list[dict[str, Any]]) -> list[Request]:
    """Submit a batch (dicts of :func:`submit`'s arguments plus ``payload``) in one round trip."""
    return default_pipeline().submit_many(items)


def get(id: str) -> Request:
    """The handle of a known request; raises :class:`UnknownRequest`."""
    return default_pipeline().get(id)


def cancel(id: str, running: str = "finish", by: str | None = None) -> bool:
    """Cancel a request (:meth:`Pipeline.cancel`; ``running="abort"`` also stops a running
    attempt); True when this call cancelled it."""
    return default_pipeline().cancel(id, running, by)


def explain(id: str) -> Explanation:
    """Where a request is and why (see :meth:`Request.explain`); raises
    :class:`UnknownRequest`."""
    return default_pipeline().explain(id)


def load_result(text: str | bytes) -> Result:
    """A stored result's JSON (a result-list entry) as a :class:`Result`, its body read back
    when it was stored apart (``payload_ref``: :meth:`Pipeline.load_result`)."""
    return default_pipeline().load_result(text)


def _batches() -> Batches:
    return Batches(default_pipeline())


def submit_batch(
    lines_or_path: Any,
    completion_window: str | float = "24h",
    metadata: dict[str, str] | None = None,
    priority: int = 0,
    queue: str = "default",
    *,
    endpoint: str | None = None,
    id: str | None = None,
) -> Batch:
    """:meth:`Batches.submit_batch` on the default pipeline: OpenAI batch lines (a JSONL
    file's path, or the lines) whose requests must all finish within ``completion_window``,
    stored as requests of ``queue`` once all are checked. ``id``: an idempotency key. A bad
    argument raises :class:`InvalidRequest` naming it, and nothing is stored. Bad lines fail
    the batch naming each line and field; an unexpected error while storing them fails it too
    and raises :class:`IngestFailed`."""
    try:
        return _batches().submit_batch(
            lines_or_path,
            completion_window=completion_window,
            metadata=metadata,
            priority=priority,
            queue=queue,
            endpoint=endpoint,
            batch_id=id,
        )
    except InvalidRequest as exc:
        if exc.field != "batch_id":
            raise
        raise InvalidRequest("id", exc.reason) from None


def get_batch(id: str) -> Batch:
    """A batch by id; raises :class:`UnknownBatch`."""
    return _batches().get(id)


def list_batches(after: str | None = None, limit: int = 20) -> list[Batch]:
    """Batches, newest first (``after``: the last id of the previous page)."""
    return _batches().list(after=after, limit=limit)[0]


def inspect() -> dict[str, Any]:
    """Per queue: pending, retry_wait, running and the gate's type, limit, in-flight, holders."""
    return default_pipeline().inspect()


__all__ = [
    "Batch",
    "ConfigError",
    "Explanation",
    "IdempotencyConflict",
    "IngestFailed",
    "InvalidRequest",
    "Pipeline",
    "PipelineError",
    "QueueConfig",
    "Request",
    "Result",
    "ReplicationError",
    "Settings",
    "StateLost",
    "StoreFull",
    "UnknownBatch",
    "UnknownRequest",
    "UnsafeRedis",
    "cancel",
    "configure",
    "explain",
    "get",
    "get_batch",
    "inspect",
    "list_batches",
    "load_result",
    "load_settings",
    "submit",
    "submit_batch",
    "submit_many",
]
