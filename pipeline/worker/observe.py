"""The attempt path's metrics, traces and Flower gate events; their errors are only logged."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..config import QueueConfig
from ..gates import Decision
from ..http.classify import Outcome
from ..http.usage import counted_path
from ..observability import metrics, tracing
from .report import Report, Status

log = logging.getLogger("pipeline.metrics")


class Attempt(Protocol):
    """What is observed of an attempt (``pipeline.worker.attempt.Attempt``)."""

    id: str
    token: str
    queue: QueueConfig
    record: dict[str, str]
    metadata: dict[str, str]
    holder: str
    outcome: Outcome | None  # of its HTTP call, once sent
    elapsed_s: float | None  # how long its HTTP call took (s)

    @property
    def decision(self) -> Decision | None: ...

    def parks_on(self, decision: Decision) -> bool: ...

    def note_span(self, traceparent: str) -> None: ...

    def run(self) -> Report: ...

    def adaptive_view(self) -> dict[str, Any] | None: ...


def attempt_started(attempt: Attempt, send_event: Callable[..., Any] | None = None) -> None:
    """After ``before_start`` asked the gate: count a first attempt and its queue residence,
    and a refusal / wait / drop (with Flower's ``task-gate-*`` event)."""
    q = attempt.queue
    s = metrics.series()
    try:
        if attempt.record.get("dispatches") == "1":
            metrics.count(s.requests, q)
            started = float(attempt.record.get("started_at") or time.time())
            submitted = float(attempt.record.get("submitted_at") or started)
            s.residence.labels(*metrics.queue_labels(q)).observe(
                max(0.0, started - submitted) * 1000
            )
        decision = attempt.decision
        if decision is not None and not decision.admitted and not attempt.parks_on(decision):
            # a refusal the attempt parks through counts only if the park ends refused
            gate_decision(attempt, decision, send_event)
    except Exception as exc:  # noqa: BLE001 - observability never breaks an attempt
        log.warning("metrics for %s failed: %s", attempt.id, exc)


def lease_lapsed(attempt: Attempt) -> None:
    """An attempt stopped by the lease guard (its lease could lapse)."""
    try:
        metrics.count(metrics.series().lease_aborts, attempt.queue)
    except Exception as exc:  # noqa: BLE001 - observability never breaks an attempt
        log.warning("metrics for %s failed: %s", attempt.id, exc)


def gate_decision(
    attempt: Attempt, decision: Decision, send_event: Callable[..., Any] | None = None
) -> None:
    reason = decision.reason if decision.reason in metrics.GATE_REASONS else "gate_closed"
    if decision.verdict.value == "drop":
        reason = "dropped"
    metrics.count(metrics.series().gate_decisions, attempt.queue, reason)
    event = metrics.GATE_EVENTS.get(decision.verdict.value)
    if send_event is None or event is None:
        return
    try:
        extra: dict[str, Any] = {}
        view = attempt.adaptive_view()
        if view is not None:  # an adaptive gate: the limit it refused at, and why it is that
            extra = {"limit": view["limit"], "signal": view["signal"], "why": view["reason"]}
        send_event(
            event,
            request_id=attempt.id,
            queue=attempt.queue.queue_name,
            reason=decision.reason or reason,
            attempt=attempt.token,
            gate=attempt.queue.gate_type,
            **extra,
        )
    except Exception as exc:  # noqa: BLE001 - a lost monitoring event is only logged
        log.warning("could not send %s for %s: %s", event, attempt.id, exc)


def observed_run(attempt: Attempt) -> Report:
    """``attempt.run()`` inside its ``process-request`` span, then count its outcome."""
    q = attempt.queue
    with tracing.attempt_span(
        attempt.id,
        q.queue_id,
        q.queue_name,
        int(attempt.record.get("attempts") or 0),
        attempt.metadata,
        payload=attempt.record.get("payload"),
        holder=attempt.holder,
    ) as span:
        traceparent = span.traceparent()
        if traceparent is not None:  # for the reaper's re-enqueue link
            attempt.note_span(traceparent)
        report = attempt.run()
        _annotate(span, attempt, report)
    try:
        s = metrics.series()
        if report.status is Status.SUCCESS:
            metrics.count(s.successes, q)
        elif report.status is Status.FAILED:
            dropped = attempt.decision is not None and attempt.decision.verdict.value == "drop"
            if not dropped and _is_deadline(report.result or {}):
                metrics.count(s.deadlines, q)
            else:
                metrics.count(s.failures, q)
        elif report.status is Status.RETRY:
            metrics.count(s.retries, q)
    except Exception as exc:  # noqa: BLE001 - observability never breaks an attempt
        log.warning("metrics for %s failed: %s", attempt.id, exc)
    return report


def _is_deadline(result: dict[str, Any]) -> bool:
    """Ended by the deadline: DEADLINE_EXCEEDED, or a kept 429/5xx no retry fitted after."""
    if result.get("error_code") == "DEADLINE_EXCEEDED":
        return True
    code = result.get("status_code")
    return not result.get("error_code") and isinstance(code, int) and (code == 429 or code >= 500)


def _annotate(span: tracing.AttemptSpan, attempt: Attempt, report: Report) -> None:
    if span.span is None:
        return
    result = report.result or {}
    outcome = attempt.outcome
    category = ""
    if outcome is not None and outcome.kind.value != "success":
        category = outcome.category
    elif result.get("error_code"):
        category = str(result["error_code"])
    elif report.status is Status.REQUEUED and attempt.decision is not None:
        category = f"GATE_{attempt.decision.verdict.name}"
    if category:
        span.set("llm_d.async.error.category", category)  # and error.category
    span.set("pipeline.outcome", report.status.value)
    if result.get("status_code") is not None:
        span.set("http.response.status_code", result["status_code"])
    if report.status is Status.FAILED:
        span.fail(str(result.get("error_code") or f"HTTP {result.get('status_code')}"))


def observed_send(
    attempt: Attempt,
    send: Callable[[str, str, dict[str, str], float], Outcome],
    url: str,
    body: str,
    headers: dict[str, str],
    timeout_s: float,
) -> Outcome:
    """``send(...)`` counted (in flight, latency, 429s, tokens) and traced (``http-request``)."""
    labels = metrics.queue_labels(attempt.queue)
    s = metrics.series()
    s.init_queue(labels)
    s.dispatched.labels(*labels).inc()
    inflight = s.inflight.labels(*labels)
    inflight.inc()
    start = time.perf_counter()
    try:
        with tracing.http_span(url, headers) as span:
            outcome = send(url, body, headers, timeout_s)
            span.set("http.response.status_code", outcome.status_code)
            if outcome.kind.value != "success":
                span.set("error.type", outcome.category or "error")
    finally:
        inflight.dec()
        attempt.elapsed_s = time.perf_counter() - start
        s.latency.labels(*labels).observe(attempt.elapsed_s * 1000)
    if outcome.status_code == 429:
        s.shed.labels(*labels).inc()
    if outcome.dropped_reason:  # the gateway's flow control shed it: count its reason
        s.gate_decisions.labels(*labels, outcome.dropped_reason).inc()
    try:  # pipeline_tokens_total{direction} from a 2xx answer's usage (the reference's rule)
        usage = outcome.usage
        if usage is not None and counted_path(url):
            s.tokens.labels(*labels, "input").inc(usage.prompt)
            s.tokens.labels(*labels, "output").inc(usage.completion)
    except Exception as exc:  # noqa: BLE001 - observability never breaks an attempt
        log.warning("counting tokens failed: %s", exc)
    attempt.outcome = outcome
    return outcome
