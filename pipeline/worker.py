"""The worker side of one attempt, independent of Celery (the task in ``tasks`` is a thin
wrapper): fenced start, gate acquisition, the HTTP call, and exactly one of finish / retry /
requeue — with the gate reservation released *before* the request leaves the attempt.

Per process there is one :class:`Runtime` (a store, the gates bound to Redis, a heartbeat
thread renewing the leases of live attempts). It is created lazily and again after a fork.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from . import metrics
from .backoff import retry_delay
from .bell import ReleaseBell, Ticket
from .config import QueueConfig, Settings, load_settings
from .gates import CONTINUE, AcquireContext, Decision, Gate, GateEnv, Verdict
from .gates.base import PreparedAcquire
from .gating import attempt_gate
from .inference import Kind, Outcome, join_url, send
from .keys import holder as make_holder
from .store import Mirror, Store, run_batch

log = logging.getLogger("pipeline.worker")

REFUSE_DELAY_S = (0.2, 1.0)  # a refused request waits this long (jittered) before re-entry
PARK_POLL_S = 0.5  # a parked attempt re-asks its gate at least this often (a lost wake-up)
RELEASE_TRIES = 4
TRANSFER_WAIT_S = 10.0  # a taker of a handed-over slot waits this long for the transfer record


class Mirrors(Protocol):
    """Copies of an attempt's outcome that its finish / requeue script writes in the same step
    (the Celery result of the attempt's task, built by ``tasks``); None: not mirrored."""

    def success(self) -> Mirror | None: ...

    def failure(self, message: str) -> Mirror | None: ...

    def retry(self, reason: str) -> Mirror | None: ...


def failure_message(
    status_code: int | None, payload: str, error_code: str | None, error_message: str | None
) -> str:
    """What a request that ended without success reports: its status or error code first."""
    code = error_code or f"HTTP {status_code}"
    return f"{code}: {(error_message if error_code else None) or payload or ''}"[:500]


class Status(enum.Enum):
    STALE = "stale"  # the message was fenced off (old token, cancelled, finished)
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


def _result_dict(result_json: str | None) -> dict[str, Any] | None:
    return json.loads(result_json) if result_json else None


class Runtime:
    """Per-process worker state."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or load_settings()
        self.store = Store(self.settings)
        self.env = GateEnv(self.store.client, self.settings.keys, node=_node_name())
        self._gates: dict[str, Gate] = {}
        self._pool_gates: dict[str, Gate | None] = {}
        self._live: dict[str, tuple[str, str, str]] = {}  # holder -> (id, token, queue)
        self._lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._stopping = threading.Event()
        self.rng = random.Random()
        self.bell = ReleaseBell(self.store.client, self.settings.keys.freed_channel())

    # -- gates ---------------------------------------------------------------------------
    def gate(self, queue: str) -> Gate:
        with self._lock:
            gate = self._gates.get(queue)
            if gate is None:
                gate = attempt_gate(self.settings, queue, self.env, self._pool_gates)
                self._gates[queue] = gate
            return gate

    def release(self, queue: str, request_id: str, token: str, *, hand_over: bool = False) -> bool:
        """Release a holder's reservation: idempotent, retried, logged when it fails.

        ``hand_over`` (the holder does hold a slot of a ``hands_over`` gate): when an attempt
        of this process is parked for one, the slot goes straight to it — it is woken at
        once, admitted, and heads for the server while this thread records the transfer.
        True when the slot was handed over (nothing was freed: the finish / requeue that
        follows publishes no release)."""
        holder = make_holder(request_id, token)
        with self._lock:
            self._live.pop(holder, None)
        if queue not in self.settings.queues:
            return False
        gate = self.gate(queue)
        if hand_over and gate.hands_over:
            ticket = self.bell.hand_over(queue)
            if ticket is not None:
                self._transfer(gate, holder, ticket)
                return True
        for i in range(RELEASE_TRIES):
            try:
                gate.release(holder)
                # the finish / requeue that follows publishes the release to other processes
                self.bell.ring(queue, echo=True)
                return False
            except Exception as exc:  # noqa: BLE001 - a release must never be silently lost
                log.warning(
                    "release of %s on gate %s failed (try %d/%d): %s",
                    holder,
                    queue,
                    i + 1,
                    RELEASE_TRIES,
                    exc,
                )
                time.sleep(0.1 * 2**i)
        log.error("release of %s on gate %s gave up; its lease will expire", holder, queue)
        return False

    def _transfer(self, gate: Gate, giver: str, ticket: Ticket) -> None:
        """Record in Redis that ``giver``'s slot now belongs to the ticket's attempt (already
        on its way to the server); retried like a release. On failure the giver's lease
        lapses (it is no longer renewed) and the taker holds nothing to release."""
        try:
            for i in range(RELEASE_TRIES):
                try:
                    ticket.held = gate.transfer(giver, ticket.ctx)
                    if not ticket.held:
                        log.warning(
                            "slot of %s handed to %s on gate %s, but its lease had lapsed and "
                            "the gate is full",
                            giver,
                            ticket.ctx.holder,
                            gate.name,
                        )
                    return
                except Exception as exc:  # noqa: BLE001 - as a release: never silently lost
                    log.warning(
                        "hand-over of %s on gate %s failed (try %d/%d): %s",
                        giver,
                        gate.name,
                        i + 1,
                        RELEASE_TRIES,
                        exc,
                    )
                    time.sleep(0.1 * 2**i)
            log.error("hand-over of %s on gate %s gave up; its lease will expire", giver, gate.name)
        finally:
            ticket.transferred.set()

    # -- heartbeat -----------------------------------------------------------------------
    def _track(self, request_id: str, token: str, queue: str) -> None:
        with self._lock:
            self._live[make_holder(request_id, token)] = (request_id, token, queue)
            if self._heartbeat is None or not self._heartbeat.is_alive():
                self._heartbeat = threading.Thread(
                    target=self._beat, name="pipeline-heartbeat", daemon=True
                )
                self._heartbeat.start()

    def _beat(self) -> None:
        period = max(0.05, self.settings.lease_s / 3.0)
        while not self._stopping.wait(period):
            with self._lock:
                live = list(self._live.values())
            if not live:
                continue
            try:
                self.store.renew(live)
                until = time.time() + self.settings.lease_s
                by_queue: dict[str, list[str]] = {}
                for rid, token, queue in live:
                    by_queue.setdefault(queue, []).append(make_holder(rid, token))
                for queue, holders in by_queue.items():
                    self.gate(queue).renew(holders, until)
            except Exception as exc:  # noqa: BLE001 - keep beating; leases tolerate a miss
                log.warning("lease renewal failed: %s", exc)

    def live_holders(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return list(self._live.values())

    # -- attempts ------------------------------------------------------------------------
    def begin(
        self, request_id: str, token: str, worker: str, queue: str | None = None
    ) -> Attempt | None:
        """Start an attempt (fenced by ``token``); None for a stale message. When the queue's
        gate can (``Gate.prepare_acquire``), its acquire goes to Redis in the same round trip
        as the start, and the attempt begins with that decision."""
        queue = queue if queue in self.settings.queues else self._queue_of(request_id)
        prepared, generation = self._prepare_acquire(queue, request_id, token, worker)
        decision: Decision | None = None
        if prepared is None:
            record = self.store.start(request_id, token, queue or "", worker)
        else:
            start = self.store.start_call(request_id, token, queue or "", worker)
            reply, acquired = run_batch(self.store.client, [start, prepared.call])
            took = not isinstance(acquired, Exception) and prepared.took(acquired)
            record = None if isinstance(reply, Exception) else self.store.started(reply)
            if record is None:
                if took:  # the start failed or was fenced off: give the new slot back
                    self.release(queue or "", request_id, token)
                if isinstance(reply, Exception):
                    raise reply
                return None
            if isinstance(acquired, Exception):  # the attempt asks its gate again
                log.warning("gate %s failed for %s: %s", queue, request_id, acquired)
            else:
                decision = prepared.decide(acquired)
        if record is None:
            return None
        try:
            attempt = Attempt(self, record, token, worker)
        except (KeyError, ValueError, TypeError) as exc:
            # a record this worker cannot read (written by hand, or corrupted): end it
            message = f"unreadable request record: {type(exc).__name__}: {exc}"
            log.error("request %s: %s", request_id, message)
            if decision is not None and decision.admitted:
                self.release(queue or "", request_id, token)
            self.store.finish(
                request_id,
                token,
                attempted=False,
                status_code=None,
                payload=json.dumps({"error": message}),
                error_code="INVALID_REQUEST",
                error_message=message,
            )
            return None
        if decision is not None:
            attempt.decision = decision
            attempt._generation = generation
        self._track(request_id, token, record["queue"])
        return attempt

    def _prepare_acquire(
        self, queue: str | None, request_id: str, token: str, worker: str
    ) -> tuple[PreparedAcquire | None, int]:
        """The queue's gate acquire as a script call, with the release bell's generation read
        before it (see ``Attempt._park``); None when the gate has none."""
        if queue not in self.settings.queues:
            return None, 0
        gate = self.gate(queue)
        generation = self.bell.generation(queue)
        holder = make_holder(request_id, token)
        try:
            lease_until = time.time() + self.settings.lease_s
            return gate.prepare_acquire(holder, worker, lease_until), generation
        except Exception as exc:  # noqa: BLE001 - the attempt asks its gate the usual way
            log.warning("gate %s could not prepare for %s: %s", queue, request_id, exc)
            return None, generation

    def _queue_of(self, request_id: str) -> str:
        queue = self.store.client.hget(self.settings.keys.request(request_id), "queue")
        return str(queue or "")

    def abandon(
        self, request_id: str, token: str, queue: str | None, *, cancel: bool, reason: str
    ) -> None:
        """An attempt ended without reporting (hard time limit, killed child, revoke,
        shutdown): release its reservation and requeue or cancel its request. Fenced and
        idempotent: a no-op when the attempt already finished."""
        queue = queue or self._queue_of(request_id)
        self.release(queue, request_id, token)
        done: bool
        if cancel:
            done = None is not self.store.finish(
                request_id,
                token,
                attempted=False,
                status_code=None,
                payload=json.dumps({"error": "cancelled"}),
                error_code="CANCELLED",
                error_message=reason,
            )
        else:
            done = self.store.requeue(request_id, token, due=time.time(), attempted=False)
        if done:
            log.warning(
                "request %s attempt %s abandoned (%s): %s",
                request_id,
                token,
                reason,
                "cancelled" if cancel else "requeued",
            )

    def stop(self) -> None:
        self._stopping.set()
        self.bell.stop()


class Attempt:
    """One attempt of one request, from a fenced start to exactly one outcome."""

    def __init__(self, runtime: Runtime, record: dict[str, str], token: str, worker: str) -> None:
        self.rt = runtime
        self.record = record
        self.id = record["id"]
        self.token = token
        self.worker = worker
        self.queue: QueueConfig = runtime.settings.queues[record["queue"]]
        self.gate = runtime.gate(self.queue.queue_name)
        self.deadline = float(record["deadline"])
        self.metadata: dict[str, str] = _json_map(record.get("metadata"), "metadata")
        self.labels: dict[str, str] = _json_map(record.get("labels"), "labels")
        self.extra_headers: dict[str, str] = _json_map(record.get("headers"), "headers")
        if "payload" not in record:
            raise KeyError("payload")
        self.decision: Decision | None = None
        self.closed = False
        self.mirrors: Mirrors | None = None  # set by the task layer
        self.mirrored: str | None = None  # the state of the mirror written, if any
        self._granted: Ticket | None = None  # the slot came by hand-over (see Runtime.release)
        self._generation = 0  # the release bell's, read before the last gate call

    @property
    def holder(self) -> str:
        return make_holder(self.id, self.token)

    def _ctx(self) -> AcquireContext:
        return AcquireContext(
            request_id=self.id,
            token=self.token,
            queue=self.queue.queue_name,
            worker=self.worker,
            lease_until=time.time() + self.rt.settings.lease_s,
            deadline=self.deadline,
            metadata=self.metadata,
            labels=self.labels,
        )

    def acquire(self) -> Decision:
        """Ask the gate (called from the task's ``before_start``)."""
        self._generation = self.rt.bell.generation(self.queue.queue_name)
        try:
            self.decision = self.gate.acquire(self._ctx())
        except Exception as exc:  # noqa: BLE001 - a gate error refuses, it never crashes
            log.warning("gate %s failed for %s: %s", self.queue.queue_name, self.id, exc)
            self.decision = Decision(Verdict.REFUSE, reason="error")
        if self.decision.labels:
            self.labels.update(self.decision.labels)
        return self.decision

    # -- outcomes (each releases first) --------------------------------------------------
    def _release(self) -> bool:
        """Release (or hand over: True) this attempt's reservation."""
        ticket = self._granted
        if ticket is not None:
            # the giver is still recording the transfer: releasing before it would leave a
            # lease behind that nobody renews (it would block a slot until it lapsed)
            ticket.transferred.wait(TRANSFER_WAIT_S)
            held = ticket.held
        else:
            held = self.decision is not None and self.decision.admitted
        return self.rt.release(self.queue.queue_name, self.id, self.token, hand_over=held)

    def _finish(
        self,
        *,
        attempted: bool,
        status_code: int | None,
        payload: str,
        error_code: str | None = None,
        error_message: str | None = None,
    ) -> Report:
        handed_over = self._release()
        ok = error_code is None and status_code is not None and status_code < 400
        failure = "" if ok else failure_message(status_code, payload, error_code, error_message)
        mirror = None
        if self.mirrors is not None:
            mirror = self.mirrors.success() if ok else self.mirrors.failure(failure)
        res = self.rt.store.finish(
            self.id,
            self.token,
            attempted=attempted,
            status_code=status_code,
            payload=payload,
            error_code=error_code,
            error_message=error_message,
            mirror=mirror,
            handed_over=handed_over,
        )
        self.closed = True
        if res is None:
            return Report(Status.STALE, "fenced off at finish")
        self.mirrored = mirror.state if mirror is not None else None
        status = Status.SUCCESS if ok else Status.FAILED
        return Report(status, failure, result=_result_dict(res))

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
        due: float,
        reason: str,
        *,
        attempted: bool,
        last: dict[str, Any] | None = None,
        error: str | None = None,
        status: Status = Status.REQUEUED,
    ) -> Report:
        handed_over = self._release()
        mirror = self.mirrors.retry(reason) if self.mirrors is not None else None
        ok = self.rt.store.requeue(
            self.id,
            self.token,
            due=due,
            attempted=attempted,
            last_response=last,
            last_error=error,
            mirror=mirror,
            handed_over=handed_over,
        )
        self.closed = True
        if not ok:
            return Report(Status.STALE, "fenced off at requeue")
        self.mirrored = mirror.state if mirror is not None else None
        return Report(status, reason, due=due)

    def _expired(self, attempted: bool, last: Outcome | None = None) -> Report:
        if last is not None and last.responded:
            return self._finish(
                attempted=attempted, status_code=last.status_code, payload=last.body
            )
        prev = self.record.get("last_response")
        if prev:
            data = json.loads(prev)
            return self._finish(
                attempted=attempted, status_code=int(data["status_code"]), payload=data["payload"]
            )
        msg = "deadline exceeded"
        error = last.error if last is not None and last.error else self.record.get("last_error")
        if error:
            msg = f"deadline exceeded (last error: {error})"
        return self._error("DEADLINE_EXCEEDED", msg, attempted)

    # -- the attempt ---------------------------------------------------------------------
    def run(self) -> Report:
        if time.time() >= self.deadline:
            return self._expired(False)
        decision = self.decision or self.acquire()
        if decision.verdict is Verdict.WAIT:
            decision = self._park(self.rt.settings.gate_wait_timeout_s)
        elif self.parks_on(decision):
            decision = self._park(self.rt.settings.park_s)
            if not decision.admitted:
                metrics.gate_decision(self, decision)
        if decision.verdict is Verdict.REFUSE:
            lo, hi = REFUSE_DELAY_S
            return self._requeue(
                time.time() + self.rt.rng.uniform(lo, hi),
                f"gate refused ({decision.reason or 'gate_closed'})",
                attempted=False,
            )
        if decision.verdict is Verdict.WAIT:
            return self._requeue(time.time(), "gate wait timed out", attempted=False)
        if decision.verdict is Verdict.DROP:
            if decision.status_code is not None or decision.payload is not None:
                return self._finish(
                    attempted=False,
                    status_code=decision.status_code,
                    payload=decision.payload or "",
                )
            return self._error("GATE_DROPPED", "dropped by gate")
        return self._call()

    def parks_on(self, decision: Decision) -> bool:
        """A full slot gate's Refuse: the attempt parks for a release (``PIPELINE_PARK_S``)
        instead of going back to the queue at once."""
        return (
            decision.verdict is Verdict.REFUSE
            and decision.wake_on_release
            and self.rt.settings.park_s > 0
        )

    def _park(self, limit_s: float) -> Decision:
        """Wait for a slot: until the gate admits (or stops saying Wait / full), the deadline,
        or ``limit_s``. Woken by the release bell the moment a holder of this queue releases;
        re-asks the gate at least every ``PARK_POLL_S`` in case a wake-up was lost. On a
        ``hands_over`` gate a holder of this process that is done hands its slot straight to
        the longest-parked attempt, admitted without asking the gate."""
        queue = self.queue.queue_name
        end = min(self.deadline, time.time() + limit_s)
        decision = self.decision or Decision(Verdict.WAIT)
        while (
            decision.verdict is Verdict.WAIT or self.parks_on(decision)
        ) and not self.rt.bell.closed:
            left = end - time.time()
            if left <= 0:
                break
            ticket = self.rt.bell.park(
                queue,
                self._generation,
                min(PARK_POLL_S, left),
                self._ctx() if self.gate.hands_over else None,
            )
            if ticket is not None and ticket.granted:
                self._granted = ticket
                decision = self.decision = CONTINUE
                break
            decision = self.acquire()
        return decision

    def headers(self) -> dict[str, str]:
        """Outgoing headers: defaults, then the request's own (they override), then the
        fairness identity (``metadata[fairness_attribute]``), which replaces any caller
        variant of that header in any letter case."""
        headers = {"Content-Type": "application/json", "x-request-id": self.id}
        if self.queue.inference_objective:
            headers["x-gateway-inference-objective"] = self.queue.inference_objective
        headers.update(self.extra_headers)
        name = self.rt.settings.fairness_header
        tenant = self.metadata.get(self.rt.settings.fairness_attribute, "")
        if name and tenant and len(tenant) <= 256 and tenant.isprintable():
            for key in [k for k in headers if k.lower() == name.lower()]:
                del headers[key]
            headers[name] = tenant
        return headers

    def url(self) -> str:
        return join_url(
            self.queue.igw_base_url, self.record.get("endpoint") or self.queue.request_path_url
        )

    def _call(self) -> Report:
        left = self.deadline - time.time()
        if left <= 0:
            return self._expired(False)
        timeout = min(self.queue.request_timeout_s, left)
        try:
            outcome = metrics.observed_send(
                self, send, self.url(), self.record["payload"], self.headers(), timeout
            )
        except Exception as exc:  # noqa: BLE001 - e.g. a soft time limit inside the call
            outcome = Outcome(
                Kind.RETRY, error=f"{type(exc).__name__}: {exc}", category="INTERRUPTED"
            )
        if outcome.kind is Kind.SUCCESS or (outcome.kind is Kind.FATAL and outcome.responded):
            return self._finish(
                attempted=True, status_code=outcome.status_code, payload=outcome.body
            )
        if outcome.kind is Kind.FATAL:
            return self._error("INFERENCE_ERROR", outcome.error or "request failed", True)
        retries = int(self.record.get("attempts") or 0)
        now = time.time()
        delay = retry_delay(
            retries,
            self.deadline - now,
            outcome.retry_after,
            self.queue.retry_base_delay_s,
            self.queue.retry_max_delay_s,
            self.rt.rng,
        )
        if delay is None:
            return self._expired(True, outcome)
        last = (
            {"status_code": outcome.status_code, "payload": outcome.body}
            if outcome.responded
            else None
        )
        reason = (
            f"HTTP {outcome.status_code}"
            if outcome.responded
            else f"{outcome.category}: {outcome.error}"
        )
        return self._requeue(
            now + delay,
            reason,
            attempted=True,
            last=last,
            error=outcome.error,
            status=Status.RETRY,
        )


def _json_map(text: str | None, field: str) -> dict[str, str]:
    """A record field holding a JSON object of str → str."""
    value = json.loads(text or "{}")
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{field} is not an object of strings")
    return value


def _node_name() -> str:
    return os.environ.get("PIPELINE_NODE") or f"{os.uname().nodename}.{os.getpid()}"


_runtimes: dict[int, Runtime] = {}
_runtime_lock = threading.Lock()
_settings_override: Settings | None = None


def use_settings(settings: Settings | None) -> None:
    """Make new runtimes use ``settings`` instead of the environment (tests, embedding)."""
    global _settings_override
    with _runtime_lock:
        _settings_override = settings
        for rt in _runtimes.values():
            rt.stop()
        _runtimes.clear()


def runtime() -> Runtime:
    """This process's runtime (a new one after a fork)."""
    pid = os.getpid()
    with _runtime_lock:
        rt = _runtimes.get(pid)
        if rt is None:
            _runtimes.clear()
            rt = _runtimes[pid] = Runtime(_settings_override)
        return rt
