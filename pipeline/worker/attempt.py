"""One attempt of one request: gate acquisition (parking for a release), the HTTP call, and
exactly one of finish / retry / requeue, its reservation released before the request leaves."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
from redis.exceptions import ClusterDownError

from ..config import QueueConfig
from ..gates import CONTINUE, AcquireContext, Decision, Verdict, observation_of
from ..gates.adaptive import adaptive_views
from ..http.backoff import MAX_ATTEMPTS_EXCEEDED, retry_delay
from ..http.call import Abort, abortable
from ..http.classify import INVALID_RESPONSE, UNSENDABLE, Kind, Outcome, join_url
from ..http.rules import (
    ATTEMPT_HEADERS,
    CONNECTION_HEADERS,
    PREFIX_HEADER,
    REQUEST_ID_HEADER,
    SLO_HEADER,
    endpoint_error,
    value_error,
)
from ..store import ScriptCall
from ..store.bodies import stored_apart
from ..store.journal import Journal, entry
from ..store.keys import ref_cancel_key
from . import observe
from .bell import Ticket
from .endpoints import authorization, queue_send
from .handover import Handover
from .identity import NO_HOOKS, AttemptId, Hooks
from .report import Mirrors, Report, Status, failure_message
from .reservation import Host, Reservation

log = logging.getLogger("pipeline.worker")

REFUSE_DELAY_S = (0.2, 1.0)  # a refused request waits this long (jittered) before re-entry
PARK_POLL_S = 0.5  # a parked attempt re-asks its gate at least this often (a lost wake-up)
TERMINAL_RETRY_S = 0.25  # a terminal write Redis could not take is tried again this often
# (a failover or a slot migration, redis-py's own retries spent), while the lease lasts
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, ClusterDownError)
ESCAPED = "ESCAPED"  # the category of an attempt ended by an exception (counted, backed off)


class Attempt:
    def __init__(
        self,
        runtime: Host,
        record: dict[str, str],
        who: AttemptId,
        worker: str,
        clock_offset: float = 0.0,
        reservation: Reservation | None = None,
        hooks: Hooks = NO_HOOKS,
    ) -> None:
        self.rt = runtime
        self.who = who
        # the Redis server's clock minus this machine's: deadlines are measured by the server's
        self.clock_offset = clock_offset
        self.record = record
        self.id = record["id"]
        self.token = token = who.token
        self.worker = worker
        self.queue: QueueConfig = runtime.settings.queues[record["queue"]]
        self.store = runtime.store.for_pool(self.queue.worker_pool_id)  # its slot on a cluster
        self.deadline = float(record["deadline"])
        self.metadata: dict[str, str] = _json_map(record.get("metadata"), "metadata")
        self.labels: dict[str, str] = _json_map(record.get("labels"), "labels")
        self.extra_headers: dict[str, str] = _json_map(record.get("headers"), "headers")
        self.holder = who.holder
        self.priority = _priority(record.get("priority"))
        name = self.queue.queue_name
        self.reservation = reservation or Reservation(
            runtime, name, self.holder, runtime.gate(name)
        )
        self.reservation.bind(
            AcquireContext(
                request_id=self.id,
                token=token,
                queue=name,
                worker=worker,
                lease_s=runtime.settings.lease_s,
                deadline=self.deadline,
                metadata=self.metadata,
                labels=self.labels,
                payload=record["payload"],
                priority=self.priority,
            )
        )
        self.closed = False
        self.mirrors: Mirrors | None = hooks.mirrors  # its task's Celery result, if mirrored
        self.send_event: Callable[..., Any] | None = hooks.send_event  # Celery's (Flower)
        self.served_tokens: int | None = 0  # what a token charge settles to (served_tokens())
        self.served_prompt: int | None = None  # the 2xx answer's prompt tokens (usage), if any
        self.journal = Journal()  # the request's decision log entries, sent with the outcome
        self.cancelled: str | None = None  # why, when cancelled while parked: it ends unsent
        self.outcome: Outcome | None = None  # of its HTTP call (observe.observed_send)
        self.elapsed_s: float | None = None  # how long its HTTP call took (observed_send)
        # fired by a cancel with running="abort" (Runtime.abort): closes the call's connection
        self.abort = Abort()
        self.lapsing = False  # the lease guard stopped it (Runtime): it ends as a retry

    @property
    def decision(self) -> Decision | None:
        return self.reservation.decision

    def time_left(self) -> float:
        return self.deadline - (time.time() + self.clock_offset)

    def acquire(self) -> Decision:
        """Ask the gate; holding nothing yet, the queue's gate under the current config (a
        reload may have replaced it); once admitted it keeps that gate until it releases."""
        res = self.reservation
        gate = None if res.admitted else self.rt.current_gate(self.queue.queue_name)
        if gate is not None and gate is not res.gate:
            res.follow(gate)
            self.queue = self.rt.settings.queues.get(self.queue.queue_name, self.queue)
        decision = res.ask()
        self.labels.update(decision.labels)
        return decision

    def _finish(
        self,
        *,
        attempted: bool,
        status_code: int | None,
        payload: str,
        error_code: str | None = None,
        error_message: str | None = None,
    ) -> Report:
        """The terminal result, in the round trip that first releases the reservation."""
        ok = error_code is None and status_code is not None and status_code < 300
        failure = "" if ok else failure_message(status_code, payload, error_code, error_message)
        mirror = None
        if self.mirrors is not None:
            mirror = self.mirrors.success() if ok else self.mirrors.failure(failure)
        limit = self.rt.settings.body_inline_max
        apart = stored_apart(payload, limit, self.record.get("wire"))  # a large body: once
        body_key = self.store.keys.body(self.id, self.token) if apart else None

        def finish(handover: Handover) -> ScriptCall:
            return self.store.finish_call(
                self.id,
                self.token,
                attempted=attempted,
                status_code=status_code,
                payload=payload,
                error_code=error_code,
                error_message=error_message,
                mirror=mirror,
                handed_over=handover.handed_over,
                nowake=handover.nowake,
                journal=self.journal,
                body_key=body_key,
            )

        before = partial(self.store.put_body, self.id, self.token, payload) if apart else None
        res = self.store.finished(self._until_written(finish, before))
        self.closed = True
        if res is None:
            return Report(Status.STALE, "fenced off at finish")
        if mirror is not None and self.mirrors is not None:
            self.mirrors.written(mirror.state)
        status = Status.SUCCESS if ok else Status.FAILED
        return Report(status, failure, result=json.loads(res) if res else None)

    def _until_written(
        self, finish: Callable[[Handover], ScriptCall], before: Callable[[], Any] | None = None
    ) -> Any:
        """Release and finish (after ``before``: storing a large body); while Redis does not
        answer (a failover: redis-py's retries last ~4 s, a promotion may take longer), the
        finish alone again, until the lease would have lapsed. The result is not thrown away:
        abandoned, the request would run again (the finish is fenced by the token: a retry of
        one that did land is a no-op)."""
        end = time.monotonic() + self.rt.settings.lease_s
        release = partial(
            self.reservation.release_with, finish, self.served_tokens, self.served_prompt
        )

        def write() -> Any:
            if before is not None:
                before()
            return release()

        while True:
            try:
                return write()  # a retry: the reservation is released already, only the finish
            except REDIS_DOWN as exc:
                if time.monotonic() + TERMINAL_RETRY_S >= end:
                    raise
                log.warning("finish of %s: Redis does not answer (%s); trying again", self.id, exc)
                time.sleep(TERMINAL_RETRY_S)

    def _error(self, code: str, message: str, attempted: bool = False) -> Report:
        return self._finish(
            attempted=attempted,
            status_code=None,
            payload=json.dumps({"error": message}),
            error_code=code,
            error_message=message,
        )

    def _requeue(
        self,
        delay: float,
        reason: str,
        *,
        attempted: bool,
        last: dict[str, Any] | None = None,
        error: str | None = None,
        status: Status = Status.REQUEUED,
        note: dict[str, Any] | None = None,
    ) -> Report:
        """Back to the queue (a retry, a refusal, a wait timed out) in the round trip that first
        releases the reservation: a retried request never holds two."""
        mirror = self.mirrors.retry(reason) if self.mirrors is not None else None

        def requeue(handover: Handover) -> ScriptCall:
            return self.store.requeue_call(
                self.id,
                self.token,
                delay=delay,
                attempted=attempted,
                last_response=last,
                last_error=error,
                mirror=mirror,
                handed_over=handover.handed_over,
                journal=self.journal,
                note=note or entry("requeued", reason=reason),
            )

        released = self.reservation.release_with(requeue, self.served_tokens, self.served_prompt)
        due = self.store.requeued(released)
        self.closed = True
        if due is None:
            return Report(Status.STALE, "fenced off at requeue")
        if mirror is not None and self.mirrors is not None:
            self.mirrors.written(mirror.state)
        return Report(status, reason, due=due)

    def _answered(self, outcome: Outcome, attempted: bool) -> Report:
        """The answer ``outcome`` got as the result (a gateway's drop reason: ``error_message``;
        a 2xx that is not JSON: ``INVALID_RESPONSE``, the body kept as its payload)."""
        if outcome.unreadable:
            return self._finish(
                attempted=attempted,
                status_code=outcome.status_code,
                payload=outcome.body,
                error_code=INVALID_RESPONSE,
                error_message=outcome.error,
            )
        return self._finish(
            attempted=attempted,
            status_code=outcome.status_code,
            payload=outcome.body,
            error_message=outcome.described if outcome.dropped_reason else None,
        )

    def _expired(self, attempted: bool, last: Outcome | None = None) -> Report:
        if last is not None and last.responded:
            return self._answered(last, attempted)
        prev = self.record.get("last_response")
        if prev:
            data = json.loads(prev)
            code = int(data["status_code"])
            reason = data.get("dropped_reason")
            return self._finish(
                attempted=attempted,
                status_code=code,
                payload=data["payload"],
                error_code=data.get("error_code"),  # INVALID_RESPONSE
                error_message=data.get("error_message")
                or (f"HTTP {code} (dropped: {reason})" if reason else None),
            )
        msg = "deadline exceeded"
        error = last.error if last is not None and last.error else self.record.get("last_error")
        if error:
            msg = f"deadline exceeded (last error: {error})"
        return self._error("DEADLINE_EXCEEDED", msg, attempted)

    def run(self) -> Report:
        """The attempt, to its one outcome. An exception that escapes it (a bug, a body no
        rule foresaw) is that outcome too: :meth:`escaped`, never a requeue with no delay."""
        try:
            return self._run()
        except REDIS_DOWN:
            raise  # not the request's doing: after_return requeues it, or its lease lapses
        except Exception as exc:
            if self.closed:
                raise
            return self.escaped(exc)

    def escaped(self, exc: Exception) -> Report:
        """An exception ended the attempt: counted as an attempt and retried after the
        backoff (within the deadline and ``max_attempts``), its reservation released."""
        log.exception("request %s: attempt %s raised", self.id, self.token, exc_info=exc)
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
        return self._retry(Outcome(Kind.RETRY, error=error, category=ESCAPED), 0.0)

    def _run(self) -> Report:
        if self.time_left() <= 0:
            return self._expired(False)
        endpoint = self.record.get("endpoint")
        if endpoint and (wrong := endpoint_error(endpoint)) is not None:  # written not by submit
            return self._error("INVALID_REQUEST", f"cannot be sent: endpoint {wrong}")
        if self.record.get("wire") and self._cancelled_by_producer():
            return self._error("CANCELLED", "cancelled")
        decision, parked = self._gate()
        if self.abort.fired:
            return self._aborted()
        if parked and self.cancelled is None:
            self._cancelled_while_parked(None)  # a notice that came while it asked its gate
        if self.cancelled is not None:  # while it waited for a slot: nothing was sent
            self.journal.add("cancelled", reason=self.cancelled)
            return self._error("CANCELLED", self.cancelled)
        if decision.verdict is Verdict.REFUSE:
            delay = decision.retry_after
            if delay is None:
                delay = self.rt.rng.uniform(*REFUSE_DELAY_S)
            reason = decision.reason or "gate_closed"
            return self._requeue(
                delay,
                f"gate refused ({reason})",
                attempted=False,
                note=self._gate_entry("refused", decision, reason=reason),
            )
        if decision.verdict is Verdict.WAIT:
            note = self._gate_entry("requeued", decision, reason="gate wait timed out")
            return self._requeue(0.0, "gate wait timed out", attempted=False, note=note)
        if decision.verdict is Verdict.DROP:
            self.journal.add("dropped", gate=decision.gate or self.reservation.gate.type_name)
            if decision.status_code is not None or decision.payload is not None:
                return self._finish(
                    attempted=False,
                    status_code=decision.status_code,
                    payload=decision.payload or "",
                )
            return self._error("GATE_DROPPED", decision.message or "dropped by gate")
        return self._call()

    def _fence_after_outage(self, decision: Decision) -> Decision:
        """Admitted after parking through a Redis outage: is the attempt still its request's
        (one round trip)? A Redis that came back without its state has an empty gate and no
        record: the slot is not this attempt's to use, so it ends unsent (aborted; its end is
        fenced off). When the check itself fails, a refusal: the attempt gives the slot and
        its request back, unsent (docs/production.md, "A wiped Redis")."""
        try:
            ours = self.store.current(self.id, self.token)
        except Exception as exc:  # noqa: BLE001 - unknown: do not send
            log.warning("request %s: cannot check its record after an outage: %s", self.id, exc)
            return Decision(Verdict.REFUSE, reason="error", gate=decision.gate)
        if not ours and self.abort.fire():
            log.warning("request %s: attempt %s admitted after a Redis outage, but its record "
                        "is gone: not sent", self.id, self.token)  # fmt: skip
        return decision

    def _gate(self) -> tuple[Decision, bool]:
        """Ask the gate, parking when it says so: its decision, and whether it parked."""
        decision = self.decision or self.acquire()
        if decision.admitted:
            self.journal.add("admitted", worker=self.worker)
            return decision, False
        if decision.verdict is Verdict.WAIT:
            return self._park(decision, self.rt.settings.gate_wait_timeout_s), True
        if self.parks_on(decision):
            decision = self._park(decision, self.rt.settings.park_s)
            if not decision.admitted:
                observe.gate_decision(self, decision, self.send_event)
            return decision, True
        return decision, False

    def _cancelled_by_producer(self) -> bool:
        """Did the reference producer that wrote it cancel this generation since?"""
        token = self.record.get("ref_token") or ""
        if not token:
            return False
        return bool(self.store.client.get(ref_cancel_key(self.id)) == token)

    def parks_on(self, decision: Decision) -> bool:
        """A full slot gate's Refuse: park for a release (``PIPELINE_PARK_S``)."""
        return (
            decision.verdict is Verdict.REFUSE
            and decision.wake_on_release
            and self.rt.settings.park_s > 0
        )

    def _gate_entry(self, event: str, decision: Decision, **fields: Any) -> dict[str, Any]:
        gate = decision.gate or self.reservation.gate.type_name
        return entry(event, gate=gate, key=decision.wake_key, **fields)

    def _park(self, first: Decision, limit_s: float) -> Decision:
        """Wait for a slot (a ring or a hand-over of the release bell, or a re-ask every
        ``PARK_POLL_S``) until admitted, no longer full, the deadline or ``limit_s``. A park
        that outlasts ``PARK_POLL_S`` sends its ``parked`` log entry at once (for ``explain``)."""
        began = time.monotonic()
        outages = self.rt.bell.outages
        end = began + min(self.time_left(), limit_s)
        wait = "wait" if first.verdict is Verdict.WAIT else "refuse"
        behind = self.reservation.behind or None
        self.journal.append(
            self._gate_entry("parked", first, reason=first.reason, verdict=wait, behind=behind)
        )
        noted = False
        decision = self.decision or Decision(Verdict.WAIT)
        while (
            decision.verdict is Verdict.WAIT or self.parks_on(decision)
        ) and not self.rt.bell.closed:
            left = end - time.monotonic()
            if left <= 0:
                break
            ticket = self.reservation.wait(decision, min(PARK_POLL_S, left))
            if ticket is not None and ticket.granted:
                decision = CONTINUE
                break
            if self._cancelled_while_parked(ticket):
                break
            decision = self.acquire()
            if not noted and not decision.admitted and time.monotonic() - began >= PARK_POLL_S:
                noted = True
                try:
                    self.store.note(self.id, self.token, self.journal)
                except Exception as exc:  # noqa: BLE001 - the log is for people; it goes on
                    log.warning("decision log note for %s failed: %s", self.id, exc)
        if decision.admitted and self.rt.bell.outages != outages:
            decision = self._fence_after_outage(decision)
        if decision.admitted:
            waited = round(time.monotonic() - began, 3)
            handed = True if self.reservation.ticket is not None else None
            self.journal.add("admitted", worker=self.worker, waited=waited, handed_over=handed)
        return decision

    def _cancelled_while_parked(self, ticket: Ticket | None) -> bool:
        """Cancelled while parked? Asked of Redis only after a cancel notice or a park that
        timed out without a ring (a lost notice), never on a ring's or hand-over's path."""
        timed_out = ticket is not None and not (ticket.rang or ticket.cancelled)
        if not (timed_out or self.rt.bell.cancelled(self.id)):
            return False
        self.cancelled = self.store.cancel_asked(self.id, self.token)
        return self.cancelled is not None

    def note_span(self, traceparent: str) -> None:
        try:
            self.store.note_span(self.id, self.token, traceparent)
        except Exception as exc:  # noqa: BLE001 - observability never breaks an attempt
            log.warning("could not note the span of %s: %s", self.id, exc)

    def headers(self) -> dict[str, str]:
        """The request's own headers without the names the pipeline sets (any letter case:
        ``Host``, the connection's, ``x-request-id``, the queue's stamps, ``Authorization``
        when the queue has a key), then ``Content-Type`` unless the request set it, the id,
        the queue's objective, the lane's, the fairness identity and the queue's API key:
        exactly one of each, the queue's value (docs/configuration.md, "What goes out")."""
        settings = self.rt.settings
        stamped = settings.stamped_headers
        bearer = authorization(self.queue)
        headers: dict[str, str] = {}
        typed = False
        for key, value in self.extra_headers.items():
            low = key.lower()
            if low in ATTEMPT_HEADERS or low in CONNECTION_HEADERS or low in stamped:
                continue
            if low == "authorization" and bearer is not None:
                continue
            typed = typed or low == "content-type"
            headers[key] = value
        if not typed:
            headers["Content-Type"] = "application/json"
        headers[REQUEST_ID_HEADER] = self.id
        objective = settings.objective_header
        if self.queue.inference_objective and objective:
            headers[objective] = self.queue.inference_objective
        for key, value in settings.merge_policy.headers(self.queue.labels).items():
            _replace(headers, key, value)  # the lane's objective replaces the queue's
        name = settings.fairness_header
        tenant = self.metadata.get(settings.fairness_attribute, "")
        if name and tenant and len(tenant) <= 256 and sendable_tenant(tenant):
            headers[name] = tenant
        if bearer is not None:
            headers["Authorization"] = bearer
        if self.queue.engine_hints:  # for a router that scores by them (llm-d's)
            _replace(headers, SLO_HEADER, str(max(0, int(self.time_left() * 1000))))
            if prefix := self.record.get("pfx"):
                _replace(headers, PREFIX_HEADER, prefix)
        return headers

    def adaptive_view(self) -> dict[str, Any] | None:
        """Its gate's adaptive limit, signal and reason (for Flower's gate events), if any."""
        views = adaptive_views(self.reservation.gate)
        return views[0] if views else None

    def body(self) -> str:
        """The request's body as sent: with the queue's ``engine_priority``, the request's
        priority as the engine's ``priority`` field (vLLM's, lower first: -priority, so the
        default 0 stays 0), unless the body names one or is not a JSON object."""
        payload = self.record["payload"]
        if not self.queue.engine_priority:
            return payload
        priority = self.priority
        if priority == 0:
            return payload
        try:
            data = json.loads(payload)
        except ValueError:
            return payload
        if not isinstance(data, dict) or "priority" in data:
            return payload
        data["priority"] = -priority
        return json.dumps(data, separators=(",", ":"))

    def _aborted(self, sent: bool = False) -> Report:
        """Cancelled with running="abort" (or found no longer its own): the request's result
        is written already; this only releases the reservation (the finish is fenced off).
        Stopped by the lease guard: :meth:`_lapsed`."""
        if self.lapsing:
            return self._lapsed(sent)
        report = self._error("CANCELLED", "cancelled (running attempt aborted)")
        if report.status is Status.STALE:  # as it should: the cancel ended the request
            return Report(Status.ABORTED, "cancelled (running attempt aborted)")
        return report

    def _call(self) -> Report:
        left = self.time_left()
        if left <= 0:
            return self._expired(False)
        timeout = min(self.queue.request_timeout_s, left)
        if self.rt.guard.late(self.reservation.proof):  # its lease could lapse: not sent
            self.lapsing = True
            return self._lapsed(False)
        outcome = self._send(timeout)
        if self.abort.fired and not (self.lapsing and outcome.responded):
            return self._aborted(sent=True)  # cancelled: whatever came back (or lapsing)
        if self.elapsed_s is not None:  # what the server showed, for gates that learn from it
            retried = int(self.record.get("attempts") or 0) > 0
            self.reservation.observation = observation_of(outcome, self.elapsed_s, retried)
        self.served_tokens = served_tokens(outcome)
        if outcome.ok_2xx and outcome.usage is not None:
            self.served_prompt = outcome.usage.prompt
        if outcome.kind is Kind.SUCCESS or (outcome.kind is Kind.FATAL and outcome.responded):
            return self._answered(outcome, True)
        if outcome.kind is Kind.FATAL and outcome.category == UNSENDABLE:  # nothing was sent
            return self._error("INVALID_REQUEST", f"cannot be sent: {outcome.error}")
        if outcome.kind is Kind.FATAL:
            return self._error("INFERENCE_ERROR", outcome.error or "request failed", True)
        return self._retry(outcome, timeout)

    def _lapsed(self, sent: bool) -> Report:
        """Stopped because its lease could lapse (no renewal taken by Redis in time): back to
        its queue, a retry if it was sent. While Redis does not answer this raises, and its
        lease lapses: the reaper frees and requeues it (fenced either way)."""
        reason = "lease renewal overdue: " + ("call aborted" if sent else "not sent")
        if sent:
            return self._retry(Outcome(Kind.RETRY, error=reason, category="LEASE"), 0.0)
        delay = self.rt.rng.uniform(*REFUSE_DELAY_S)
        return self._requeue(delay, reason, attempted=False)

    def _send(self, timeout: float) -> Outcome:
        """The request sent and its answer classified (abortable by a cancel notice)."""
        try:
            with abortable(self.abort):
                return observe.observed_send(
                    self,
                    queue_send(self.queue),
                    join_url(
                        self.queue.igw_base_url,
                        self.record.get("endpoint") or self.queue.request_path_url,
                    ),
                    self.body(),
                    self.headers(),
                    timeout,
                )
        except Exception as exc:  # noqa: BLE001 - e.g. a soft time limit inside the call
            return Outcome(Kind.RETRY, error=f"{type(exc).__name__}: {exc}", category="INTERRUPTED")

    def _retry(self, outcome: Outcome, timeout: float) -> Report:
        """A retriable outcome: requeued after its backoff, or the last result when the
        deadline leaves no room for another attempt."""
        retries = int(self.record.get("attempts") or 0)
        if retries + 1 >= self.queue.max_attempts and not outcome.busy:
            return self._exhausted(outcome, retries + 1)
        delay = retry_delay(
            retries,
            self.time_left(),
            outcome.retry_after,
            self.queue.retry_base_delay_s,
            self.queue.retry_max_delay_s,
            self.rt.rng,
        )
        if delay is None:
            if timeout < self.queue.request_timeout_s and outcome.category == "TIMEOUT":
                # the deadline cut this attempt short: an earlier attempt's error says more
                return self._expired(True, None if self.record.get("last_error") else outcome)
            return self._expired(True, outcome)
        last: dict[str, Any] | None = None
        if outcome.responded:
            last = {"status_code": outcome.status_code, "payload": outcome.body}
            if outcome.dropped_reason:
                last["dropped_reason"] = outcome.dropped_reason
            if outcome.unreadable:  # its result, if the deadline ends it waiting
                last.update(error_code=INVALID_RESPONSE, error_message=outcome.error)
        reason = outcome.described if outcome.responded else f"{outcome.category}: {outcome.error}"
        note = entry(
            "retry",
            attempt=retries + 1,
            status=outcome.status_code if outcome.responded else None,
            error=None if outcome.responded and not outcome.unreadable else reason,
            dropped=outcome.dropped_reason,
            retry_after=outcome.retry_after,
        )
        return self._requeue(
            delay,
            reason,
            attempted=True,
            last=last,
            error=outcome.error,
            status=Status.RETRY,
            note=note,
        )

    def _exhausted(self, outcome: Outcome, attempts: int) -> Report:
        """The queue's ``max_attempts`` spent: ``MAX_ATTEMPTS_EXCEEDED``, with the last answer
        (its status and body) when there was one."""
        last = outcome.described if outcome.responded else f"{outcome.category}: {outcome.error}"
        message = f"gave up after {attempts} attempts (max_attempts); last: {last}"[:500]
        self.journal.add("poison", attempts=attempts, last=last[:200])
        return self._finish(
            attempted=True,
            status_code=outcome.status_code,
            payload=outcome.body if outcome.responded else json.dumps({"error": message}),
            error_code=MAX_ATTEMPTS_EXCEEDED,
            error_message=message,
        )


def served_tokens(outcome: Outcome) -> int | None:
    """What a token charge settles to: a 2xx's usage; 0 for another answer or a request never
    sent; None (keep the estimate) when no usage says what the server may have generated."""
    if outcome.responded:
        if not outcome.ok_2xx:
            return 0
        usage = outcome.usage
        return usage.total if usage is not None else None
    return 0 if outcome.kind is Kind.FATAL or outcome.category == "TLS" else None


def sendable_tenant(tenant: str) -> bool:
    """Whether a tenant goes out as the fairness header: printable, and a value the client can
    send (else the header is left out, as llm-d-async leaves it out)."""
    return tenant.isprintable() and value_error(tenant) is None


def _priority(value: str | None) -> int:
    """A record's priority (0-9); 0 when absent or unreadable."""
    try:
        return max(0, min(9, int(value or 0)))
    except ValueError:
        return 0


def _replace(headers: dict[str, str], name: str, value: str) -> None:
    for key in [k for k in headers if k.lower() == name.lower()]:
        del headers[key]
    headers[name] = value


def _json_map(text: str | None, field: str) -> dict[str, str]:
    value = json.loads(text or "{}")
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{field} is not an object of strings")
    return value
