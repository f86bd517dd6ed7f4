"""The inference task: one Celery task run per attempt of a request (task id = request id).

Gate protocol hook points:
- ``before_start`` begins the attempt (fenced by its token) and acquires the gate.
- The body releases before it writes a result or re-queues (retry, refusal).
- ``after_return`` (success, failure, and in the main process after a hard time limit or a
  lost child) releases again and requeues an attempt that never reported — idempotent.
- ``task_revoked`` and worker shutdown release too (see ``tasks.node``).
Celery skips ``after_return`` for RETRY/IGNORED; that is why the body releases first.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Retry

from pipeline import metrics
from pipeline.worker import Attempt, Status, runtime

from .app import app

log = logging.getLogger("pipeline.task")


class RequestFailed(Exception):
    """The request ended without success; the message names its status or error code."""


class AttemptRetry(Retry):
    """RETRY of an attempt; its repr (what Flower shows as the exception) names the reason."""

    def __repr__(self) -> str:
        return f"Retry({self.message!r}, {self.humanize()})"


class InferenceTask(Task):
    name = "pipeline.infer"
    acks_late = True
    throws = (RequestFailed,)
    typing = False

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request_id, token = args[0], args[1]
        attempt = runtime().begin(
            request_id, token, self.request.hostname or "worker", kwargs.get("queue")
        )
        if attempt is not None:
            attempt.acquire()
            metrics.attempt_started(attempt, self.send_event)
        self.request.pipeline_attempt = attempt

    def run(self, request_id: str, token: str, **info: Any) -> dict[str, Any] | None:
        attempt: Attempt | None = getattr(self.request, "pipeline_attempt", None)
        if attempt is None:
            raise Ignore()
        report = metrics.observed_run(attempt)
        if report.status is Status.SUCCESS:
            return report.result
        if report.status is Status.FAILED:
            res = report.result or {}
            code = res.get("error_code") or f"HTTP {res.get('status_code')}"
            raise RequestFailed(
                f"{code}: {res.get('error_message') or res.get('payload', '')}"[:500]
            )
        if report.status in (Status.RETRY, Status.REQUEUED):
            when = datetime.fromtimestamp(report.due or 0, UTC)
            raise AttemptRetry(report.reason, when=when)
        raise Ignore()

    def after_return(
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        einfo: Any,
    ) -> None:
        attempt: Attempt | None = getattr(self.request, "pipeline_attempt", None)
        if attempt is not None and attempt.closed:
            return
        if len(args) < 2:
            return
        # The attempt did not report (an exception, or this is the main process after a hard
        # time limit / lost child): release and requeue, fenced by token.
        runtime().abandon(
            args[0],
            args[1],
            kwargs.get("queue"),
            cancel=False,
            reason=f"attempt ended with {status} without a result",
        )


infer = app.register_task(InferenceTask())
