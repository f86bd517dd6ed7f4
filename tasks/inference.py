"""The inference task: one Celery task run per attempt of a request (task id = request id).

Gate protocol hook points:
- ``before_start`` begins the attempt (fenced by its token) and acquires the gate.
- ``run`` runs it in one ``try``/``finally``: the attempt releases in the round trip that
  writes its result or re-queues it (retry, refusal), and the ``finally`` releases whatever
  ended it otherwise (``Reservation.close``: a no-op once a release went out).
- ``after_return`` (success, failure, and in the main process after a hard time limit or a
  lost child, where no ``finally`` ran) releases and requeues an attempt that never
  reported — fenced, idempotent.
- ``task_revoked`` and worker shutdown release too (see ``tasks.node``); the reaper frees
  the leases of a process that died.
Celery skips ``after_return`` for RETRY/IGNORED; that is why the body releases first.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from celery import Task, states
from celery.exceptions import Ignore, Retry

from pipeline.observability import logs
from pipeline.store import Mirror
from pipeline.worker import Attempt, Status, observe, runtime
from pipeline.worker.attempt import REDIS_DOWN
from pipeline.worker.identity import AttemptId, Hooks

from .app import app
from .backend import PipelineRedisBackend

log = logging.getLogger("pipeline.task")


def brief(exc: BaseException) -> str:
    """The traceback an attempt's script stores with a RETRY or FAILURE it mirrors: the
    exception's one line, not the frames of Celery's tracer."""
    return "".join(traceback.format_exception_only(type(exc), exc))


class RequestFailed(Exception):
    """The request ended without success; the message names its status or error code."""


class AttemptRetry(Retry):
    """RETRY of an attempt; its repr (what Flower shows as the exception) names the reason."""

    def __repr__(self) -> str:
        return f"Retry({self.message!r}, {self.humanize()})"


class TaskResult(Mapping[str, Any]):
    """A request's terminal result as the task's return value: the whole result for Celery's
    result backend (``__json__``, the JSON kombu writes), but only its summary — id, status,
    attempts, latency, no response body unless ``PIPELINE_LOG_BODIES=1`` — as its ``repr``,
    which is what Celery's "Task … succeeded in …s: …" log line and Flower's result column
    show (``celery.app.trace`` logs ``saferepr`` of the return value, and ``saferepr`` takes
    the ``repr`` of anything that is not a plain container)."""

    __slots__ = ("_result",)

    def __init__(self, result: dict[str, Any]) -> None:
        self._result = result

    def __getitem__(self, key: str) -> Any:
        return self._result[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._result)

    def __len__(self) -> int:
        return len(self._result)

    def __json__(self) -> dict[str, Any]:
        return self._result

    def __repr__(self) -> str:
        return repr(logs.result_summary(self._result, logs.log_bodies()))


def _log_outcome(report: Any) -> None:
    """Put the attempt's outcome into the log context of the lines Celery logs next."""
    result = report.result
    if result is not None:
        summary = logs.result_summary(result)
        status = summary.get("status_code") or summary.get("error_code")
        logs.bind(status=status, attempts=summary["attempts"], latency_s=summary.get("latency_s"))
    else:
        logs.bind(status=report.status.value)


class CeleryMirrors:
    """An attempt's outcome as its task's Celery result (SUCCESS, FAILURE, RETRY), for the
    attempt's own finish / requeue script to write (see ``tasks.backend``)."""

    def __init__(self, backend: PipelineRedisBackend, task_id: str) -> None:
        self.backend = backend
        self.task_id = task_id

    def success(self) -> Mirror | None:
        return self.backend.mirror(self.task_id, states.SUCCESS, embed=True)

    def failure(self, message: str) -> Mirror | None:
        exc = RequestFailed(message)
        return self.backend.mirror(self.task_id, states.FAILURE, result=exc, traceback=brief(exc))

    def retry(self, reason: str) -> Mirror | None:
        return self.backend.mirror(
            self.task_id,
            states.RETRY,
            traceback=brief(AttemptRetry(reason)),
        )

    def written(self, state: str) -> None:
        self.backend.mirrored(self.task_id, state)


def attempt_id(args: Sequence[Any], kwargs: Mapping[str, Any]) -> AttemptId | None:
    """Who a ``pipeline.infer`` message's attempt is: ``(request_id, token)`` and the
    dispatcher's ``queue``, ``attempt``, ``tenant`` and ``priority`` kwargs (see
    ``tasks.node.send_to_celery``); None when its arguments are not that shape."""
    if len(args) < 2:
        return None
    number = kwargs.get("attempt")
    return AttemptId(
        args[0],
        args[1],
        queue=kwargs.get("queue"),
        number=number if isinstance(number, int) and not isinstance(number, bool) else None,
        tenant=_tenant(kwargs.get("tenant")),
        priority=_priority(kwargs.get("priority")),
    )


def _tenant(hint: Any) -> dict[str, str] | None:
    """The dispatcher's ``tenant`` kwarg (``{attribute: value}``, see ``Runtime.begin``), or
    None when absent or not that shape (a message written by hand)."""
    if not isinstance(hint, dict) or not hint:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in hint.items()):
        return None
    return hint


def _priority(hint: Any) -> int | None:
    """The dispatcher's ``priority`` kwarg (0-9), or None when absent or not one."""
    if isinstance(hint, bool) or not isinstance(hint, int) or not 0 <= hint <= 9:
        return None
    return hint


def mirrors_results(task: Task, request: Any) -> bool:
    """Whether an attempt's scripts can write its task's Celery result: Celery would store
    it (not ignored, not eager), in the pipeline's own Redis, as a plain meta (no extended
    result fields, no group, parent or chord to update)."""
    backend = task.backend
    return (
        isinstance(backend, PipelineRedisBackend)
        and str(task.app.conf.result_backend) == runtime().settings.redis_url
        and not task.app.conf.result_extended
        and not task.ignore_result
        and not getattr(request, "ignore_result", False)
        and not getattr(request, "is_eager", False)
        and not (request.group or request.parent_id or request.chord)
    )


def _escaped(attempt: Attempt, exc: Any) -> bool:
    """An exception raised around the attempt in this process (``Attempt.run`` takes its
    own): the attempt's outcome, counted and backed off (``Attempt.escaped``), never a requeue
    with no delay. False when it is not one (Redis down) or that failed too: abandon it."""
    if not isinstance(exc, Exception) or isinstance(exc, REDIS_DOWN):
        return False
    try:
        attempt.escaped(exc)
    except Exception as again:  # noqa: BLE001 - abandoned instead (released, requeued)
        log.warning("request %s: its escaped exception not handled: %s", attempt.id, again)
        return False
    return True


class InferenceTask(Task):
    name = "pipeline.infer"
    acks_late = True
    throws = (RequestFailed,)
    typing = False

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        who = attempt_id(args, kwargs)
        if who is None:
            raise TypeError(f"{self.name} takes (request_id, token), not {len(args)} arguments")
        logs.bind(request_id=who.request_id, queue=who.queue, attempt=who.number)
        mirrors = (
            CeleryMirrors(self.backend, task_id) if mirrors_results(self, self.request) else None
        )
        hooks = Hooks(mirrors=mirrors, send_event=self.send_event)
        attempt = runtime().begin(who, self.request.hostname or "worker", hooks)
        if attempt is not None:
            if attempt.decision is None:  # not decided with the start (Runtime.begin)
                attempt.acquire()
            observe.attempt_started(attempt, self.send_event)
        self.request.pipeline_attempt = attempt

    def run(self, request_id: str, token: str, **info: Any) -> TaskResult | None:
        attempt: Attempt | None = getattr(self.request, "pipeline_attempt", None)
        if attempt is None:
            raise Ignore()
        try:  # acquired in before_start; released by its finish / requeue's round trip...
            report = observe.observed_run(attempt)
        finally:  # ...or here, whatever ended it: the reservation's one exit (idempotent)
            attempt.reservation.close()
        _log_outcome(report)
        if report.status is Status.SUCCESS:
            return None if report.result is None else TaskResult(report.result)
        if report.status is Status.FAILED:
            raise RequestFailed(report.reason)
        if report.status in (Status.RETRY, Status.REQUEUED):
            when = datetime.fromtimestamp(report.due or 0, UTC)
            raise AttemptRetry(report.reason, when=when)
        if report.status is Status.ABORTED:  # Flower shows it REVOKED, as a terminated task
            self.send_event("task-revoked", terminated=True, signum=None, expired=False)
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
        who = attempt.who if attempt is not None else attempt_id(args, kwargs)
        if who is None:
            return
        # a FAILURE's retval is the exception (Celery passes no einfo to after_return)
        if status == states.FAILURE and attempt is not None and _escaped(attempt, retval):
            return
        # The attempt did not report (an exception, or this is the main process after a hard
        # time limit / lost child): release (here, a no-op after run's) and requeue, fenced.
        runtime().abandon(
            who,
            cancel=False,
            reason=f"attempt ended with {status} without a result",
            reservation=None if attempt is None else attempt.reservation,
        )


infer = app.register_task(InferenceTask())
