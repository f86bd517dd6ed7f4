"""The release contract, one exit at a time, in milliseconds: no Redis, no worker process.

The real ``pipeline.infer`` task runs through Celery's own tracer (``Task.apply``: the same
``build_tracer`` a worker uses, so ``after_return`` is skipped for RETRY and IGNORED exactly as
in a worker), on the real ``Runtime``, ``Attempt``, ``Reservation`` and ``ReleaseBell``. Faked
are only the seams below them: the gate (:class:`FakeGate`, which records every take and
release per holder), the request store (:class:`FakeStore`, fenced by the attempt token like
the Lua scripts), one round trip of script calls (``run_batch``) and the HTTP send.

The store notes each result and requeue it writes in the gate's event list, so a test reads
one timeline per holder (``take``, ``release``, ``result``...): the release comes before the
request leaves the attempt. Every test ends with :func:`released_once`: after a holder's last
take, exactly one release (a hand-over counts as the giver's release), and no gate holds
anything. The end-to-end proof,
with real Redis, workers and the simulator, is ``tests/integration/test_release_paths.py``.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from celery import states

from pipeline.config import load_settings
from pipeline.gates import (
    CONTINUE,
    AcquireContext,
    Admission,
    Batched,
    Calls,
    Decision,
    Gate,
    HandsOver,
    Verdict,
)
from pipeline.http.classify import Kind, Outcome
from pipeline.http.rules import REQUEST_ID_HEADER
from pipeline.store.state import Started
from pipeline.worker import attempt as attempt_module
from pipeline.worker import process as process_module
from pipeline.worker import reservation as reservation_module
from pipeline.worker.bell import ReleaseBell
from pipeline.worker.process import Runtime

QUEUE = "default"
BOUND_S = 10.0  # what a poll for another thread's step waits at most (it takes milliseconds)

# --------------------------------------------------------------------------- the gate seam


class FakeGate(Gate):
    """A slot gate of ``capacity`` slots, asked directly (neither Batched nor HandsOver): it
    answers ``answers`` in turn, then CONTINUE while a slot is free and a parkable REFUSE when
    full. ``events`` is every take, refusal, release and hand-over, per holder."""

    type_name = "fake"

    def __init__(self, capacity: int = 1, answers: Sequence[Decision] = ()) -> None:
        super().__init__(QUEUE, {}, None)
        self.cap = capacity
        self.answers = list(answers)
        self.held: set[str] = set()
        self.events: list[tuple[str, str]] = []  # (what, holder)
        self.failing_releases = 0  # the next this many releases raise
        self.lock = threading.Lock()

    def capacity(self) -> int | None:
        return self.cap

    def acquire(self, ctx: AcquireContext) -> Decision:
        with self.lock:
            decision = self.answers.pop(0) if self.answers else self._free(ctx.holder)
            if decision.admitted:
                self.held.add(ctx.holder)
            self.events.append(("take" if decision.admitted else "refused", ctx.holder))
            return decision

    def _free(self, holder: str) -> Decision:
        if holder in self.held or len(self.held) < self.cap:
            return CONTINUE
        return Decision(Verdict.REFUSE, reason="gate_closed", wake_on_release=True)

    def release(self, holder: str) -> bool:
        with self.lock:
            self.events.append(("release", holder))
            if self.failing_releases > 0:
                self.failing_releases -= 1
                raise ConnectionError("the gate's Redis does not answer")
            freed = holder in self.held
            self.held.discard(holder)
            return freed

    def lapse(self, holder: str) -> None:
        """``holder``'s lease ran out: the reaper frees its slot."""
        with self.lock:
            self.held.discard(holder)
            self.events.append(("lapsed", holder))

    def of(self, holder: str) -> list[str]:
        return [what for what, h in self.events if h == holder]


class BatchedGate(FakeGate, Batched):
    """A gate whose acquire goes in the attempt's start round trip (``Runtime.begin``)."""

    def acquire_calls(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str],
        behind: bool = False,
        priority: int | None = None,
    ) -> Calls[Admission] | None:
        def take() -> bool:
            with self.lock:
                self.held.add(holder)
                self.events.append(("take", holder))
            return True

        return Calls((take,), lambda replies: (CONTINUE, bool(replies[0])))  # type: ignore[arg-type]

    def release_calls(self, holder: str) -> Calls[bool] | None:
        return None  # released directly


class HandOverGate(FakeGate, HandsOver):
    """A slot gate whose done holder hands its slot to an attempt of its process parked on the
    queue's bell; the transfer finds no slot when the giver's lease lapsed and the gate is
    full (what ``transfer.lua`` answers then)."""

    def handover_bells(self, queue: str, metadata: Mapping[str, str]) -> tuple[str, ...]:
        return (queue,)

    def transfer_calls(self, giver: str, ctx: AcquireContext, bell: str) -> Calls[bool]:
        def transfer(_: Sequence[Any]) -> bool:
            with self.lock:
                self.events.append(("handed", giver))
                had = giver in self.held
                self.held.discard(giver)
                if had or len(self.held) < self.cap:
                    self.held.add(ctx.holder)
                    self.events.append(("take", ctx.holder))
                    return True
                return False

        return Calls((), transfer)


def released_once(gate: FakeGate, *holders: str) -> None:
    """The contract: after each holder's last take exactly one release (a hand-over is the
    giver's), none before a take that did not follow one; and nothing held."""
    for holder in holders:
        events = gate.of(holder)
        takes = [i for i, e in enumerate(events) if e == "take"]
        after = events[takes[-1] + 1 :] if takes else events
        ends = [e for e in after if e in ("release", "handed")]
        assert len(ends) == 1, f"{holder}: {events}"
        for a, b in itertools.pairwise(takes):  # every earlier take was given back once
            assert [e for e in events[a + 1 : b] if e in ("release", "handed")] == ["release"]
    assert gate.held == set(), gate.events


# -------------------------------------------------------------------------- the store seam


@dataclass
class Row:
    record: dict[str, str]
    token: str = ""  # the current attempt's (a start with another one is stale)
    result: dict[str, Any] | None = None
    requeues: list[dict[str, Any]] = field(default_factory=list)


class FakeStore:
    """Request records with what the Lua scripts guarantee an attempt: start, finish and
    requeue are fenced by the attempt token, a finished request takes no second result."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.client = SimpleNamespace(get=lambda key: None)  # a producer's cancel: none
        # where a result or requeue written is noted, as ("result" | "requeued", holder): the
        # gate's events, so a test sees the release come before it
        self.log: list[tuple[str, str]] = []
        self.broken_finish: Exception | None = None  # the next finish call's build raises it

    def add(self, rid: str, token: str, **fields: str) -> None:
        now = time.time()
        record = {
            "id": rid,
            "queue": QUEUE,
            "deadline": str(now + 300),
            "payload": json.dumps({"model": "m", "prompt": "hi"}),
            "metadata": "{}",
            "labels": "{}",
            "headers": "{}",
            "attempts": "0",
            "dispatches": "1",
            "submitted_at": str(now),
            "started_at": str(now),
            **fields,
        }
        self.rows[rid] = Row(record, token)

    def for_pool(self, pool: str) -> FakeStore:
        return self

    def find(self, request_id: str, queues: Any) -> FakeStore:
        return self

    def start_call(self, rid: str, token: str, queue: str, worker: str) -> Callable[[], Any]:
        def start() -> Started | None:
            row = self.rows.get(rid)
            if row is None or row.token != token or row.result is not None:
                return None
            return Started(dict(row.record), 0.0)

        return start

    @staticmethod
    def started(reply: Any) -> Started | None:
        return reply  # type: ignore[no-any-return]

    def finish_call(self, rid: str, token: str, **kw: Any) -> Callable[[], Any]:
        if self.broken_finish is not None:
            exc, self.broken_finish = self.broken_finish, None
            raise exc

        def finish() -> str | None:
            row = self.rows[rid]
            if row.token != token or row.result is not None:
                return None
            row.result = {
                "id": rid,
                "status_code": kw["status_code"],
                "error_code": kw.get("error_code"),
                "attempts": int(row.record["attempts"]) + (1 if kw["attempted"] else 0),
            }
            self.log.append(("result", f"{rid}:{token}"))
            return json.dumps(row.result)

        return finish

    @staticmethod
    def finished(reply: Any) -> str | None:
        return reply or None

    def finish(self, rid: str, token: str, **kw: Any) -> str | None:
        return self.finished(self.finish_call(rid, token, **kw)())

    def requeue_call(self, rid: str, token: str, **kw: Any) -> Callable[[], Any]:
        def requeue() -> float | None:
            row = self.rows[rid]
            if row.token != token or row.result is not None:
                return None
            row.token = ""  # the next dispatch gets a new token
            row.requeues.append(kw)
            self.log.append(("requeued", f"{rid}:{token}"))
            return time.time() + float(kw["delay"])

        return requeue

    @staticmethod
    def requeued(reply: Any) -> float | None:
        return float(reply) if reply else None

    def requeue(self, rid: str, token: str, **kw: Any) -> float | None:
        return self.requeued(self.requeue_call(rid, token, **kw)())

    def cancel(self, rid: str) -> None:
        """``cancel(running="abort")``: the cancel writes the result, fencing the attempt off."""
        row = self.rows[rid]
        row.result = {"id": rid, "error_code": "CANCELLED"}

    def note(self, rid: str, token: str, journal: Any) -> bool:
        journal.take()
        return True

    def cancel_asked(self, rid: str, token: str) -> str | None:
        return None

    def note_span(self, rid: str, token: str, traceparent: str) -> None:
        return None

    def attempt_span(self, rid: str, token: str) -> str | None:
        return None


def run_batch(client: Any, calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """One round trip: each call in order, a failed one's error in its place."""
    out: list[Any] = []
    for call in calls:
        try:
            out.append(call())
        except Exception as exc:  # noqa: BLE001 - as the real one does
            out.append(exc)
    return out


# ------------------------------------------------------------------- the process and task


class LocalBell(ReleaseBell):
    """The real bell (parking, rings, hand-overs) without its Pub/Sub listeners."""

    def _listen(self) -> None:
        return None

    def listen_for_aborts(self) -> None:
        return None


class ContractRuntime(Runtime):
    """The real per-process runtime on the fakes: one gate for the queue."""

    def __init__(self, gate: FakeGate, store: FakeStore, **env: str) -> None:
        settings = load_settings(
            {
                "PIPELINE_ENDPOINT": "http://model.invalid:9",
                "PIPELINE_REDIS_URL": "redis://127.0.0.1:1/0",  # never connected to
                **env,
            }
        )
        super().__init__(settings)
        self.store = store  # type: ignore[assignment]
        self.bell = LocalBell(None, [])  # type: ignore[arg-type]
        self.bell.on_abort = self.abort
        self.fake_gate = gate

    def gate(self, queue: str) -> Gate:
        return self.fake_gate


Send = Callable[[str, str], Outcome]  # (request id, token) -> the server's answer


def ok(rid: str, token: str) -> Outcome:
    return Outcome(Kind.SUCCESS, 200, json.dumps({"choices": [], "usage": None}))


@dataclass
class Traced:
    state: str  # Celery's: SUCCESS, FAILURE, RETRY, IGNORED
    after_return: bool  # whether Celery called it


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    import tasks.inference as inference

    w = World(inference)
    # Celery caches its result backend on the app at first use, with the configuration of that
    # moment: a backend made here (no Redis of the session's yet) would serve the integration
    # tests of this process. What was cached before comes back after.
    app = inference.infer.app
    monkeypatch.setattr(app, "_backend_cache", app._backend_cache)  # a thread-safe one
    monkeypatch.setattr(app._local, "backend", getattr(app._local, "backend", None), raising=False)
    monkeypatch.setattr(inference, "runtime", lambda: w.rt)
    monkeypatch.setattr(inference.infer, "send_event", w.event, raising=False)
    monkeypatch.setattr(process_module, "run_batch", run_batch)
    monkeypatch.setattr(attempt_module, "queue_send", lambda q: w.send_http)
    after = inference.InferenceTask.after_return

    def noted(task: Any, status: str, *args: Any) -> None:
        w.local.after_returns.append(status)  # this thread's attempt
        after(task, status, *args)

    monkeypatch.setattr(inference.InferenceTask, "after_return", noted)
    yield w
    if w.rt is not None:
        w.rt.stop()  # its heartbeat thread


class World:
    def __init__(self, inference: Any) -> None:
        self.task = inference.infer
        self.store = FakeStore()
        self.gate: FakeGate = FakeGate()
        self.rt: ContractRuntime | None = None
        self.events: list[str] = []  # Flower events the task sent (their names)
        self.sends: dict[str, Send] = {}  # per request id
        self.local = threading.local()

    def event(self, name: str, **fields: Any) -> None:
        self.events.append(name)

    def use(self, gate: FakeGate, **env: str) -> ContractRuntime:
        self.gate = gate
        self.store.log = gate.events
        self.rt = ContractRuntime(gate, self.store, **env)
        return self.rt

    def send_http(self, url: str, body: str, headers: dict[str, str], timeout: float) -> Outcome:
        rid = headers[REQUEST_ID_HEADER]
        return self.sends.get(rid, ok)(rid, self.local.token)

    def trace(self, rid: str, token: str, **kwargs: Any) -> Traced:
        """One attempt through Celery's tracer, as a worker runs a ``pipeline.infer`` message."""
        if self.rt is None:
            self.use(self.gate)
        self.local.token, self.local.after_returns = token, []
        result = self.task.apply(
            args=(rid, token), kwargs={"queue": QUEUE, "attempt": 1, **kwargs}, task_id=rid
        )
        return Traced(result.state, bool(self.local.after_returns))


def holder(rid: str, token: str) -> str:
    return f"{rid}:{token}"


# --------------------------------------------------------------------------- the exits


def test_success_releases_once_before_the_result(world: World) -> None:
    world.store.add("r1", "t1")
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.SUCCESS, after_return=True)  # which returns: the body released
    assert world.store.rows["r1"].result is not None
    assert world.store.rows["r1"].result["status_code"] == 200
    assert world.gate.of(holder("r1", "t1")) == ["take", "release", "result"]
    released_once(world.gate, holder("r1", "t1"))


def test_a_terminal_failure_releases_once(world: World) -> None:
    world.store.add("r1", "t1")
    world.sends["r1"] = lambda rid, token: Outcome(Kind.FATAL, 400, '{"error": "bad"}')
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.FAILURE, after_return=True)
    assert world.store.rows["r1"].result is not None
    assert world.store.rows["r1"].result["status_code"] == 400
    assert world.gate.of(holder("r1", "t1")) == ["take", "release", "result"]
    released_once(world.gate, holder("r1", "t1"))


def test_a_retry_releases_in_the_body_where_celery_skips_after_return(world: World) -> None:
    world.store.add("r1", "t1")
    answers = iter([Outcome(Kind.RETRY, 503, "busy", category="SERVER_ERROR")])
    world.sends["r1"] = lambda rid, token: next(answers, None) or ok(rid, token)
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.RETRY, after_return=False)
    assert world.store.rows["r1"].requeues[0]["attempted"] is True
    assert world.gate.of(holder("r1", "t1")) == ["take", "release", "requeued"]
    world.store.rows["r1"].token = "t2"  # the retry's dispatch
    assert world.trace("r1", "t2").state == states.SUCCESS
    released_once(world.gate, holder("r1", "t1"), holder("r1", "t2"))


def test_a_refusal_requeues_and_releases_once(world: World) -> None:
    world.use(FakeGate(answers=[Decision(Verdict.REFUSE, reason="gate_closed")]))
    world.store.add("r1", "t1")
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.RETRY, after_return=False)
    assert world.store.rows["r1"].requeues[0]["attempted"] is False
    assert world.gate.of(holder("r1", "t1")) == ["refused", "release", "requeued"]
    assert world.events == ["task-gate-refused"]
    released_once(world.gate, holder("r1", "t1"))


def test_a_gate_wait_that_times_out_requeues_and_releases_once(world: World) -> None:
    waits = [Decision(Verdict.WAIT, reason="gate_closed")] * 1000  # it never opens
    world.use(FakeGate(answers=waits), PIPELINE_GATE_WAIT_TIMEOUT_S="0.05")
    world.store.add("r1", "t1")
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.RETRY, after_return=False)
    assert world.store.rows["r1"].requeues[0]["note"]["reason"] == "gate wait timed out"
    assert world.gate.of(holder("r1", "t1"))[-2:] == ["release", "requeued"]
    released_once(world.gate, holder("r1", "t1"))


def test_a_drop_ends_the_request_and_releases_once(world: World) -> None:
    world.use(FakeGate(answers=[Decision(Verdict.DROP, reason="dropped", message="shed")]))
    world.store.add("r1", "t1")
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.FAILURE, after_return=True)
    assert world.store.rows["r1"].result is not None
    assert world.store.rows["r1"].result["error_code"] == "GATE_DROPPED"
    assert world.gate.of(holder("r1", "t1")) == ["refused", "release", "result"]
    released_once(world.gate, holder("r1", "t1"))


def test_an_abort_releases_once_and_keeps_the_cancel_s_result(world: World) -> None:
    world.store.add("r1", "t1")

    def cancelled_while_sent(rid: str, token: str) -> Outcome:
        world.store.cancel(rid)  # cancel(running="abort") writes the result...
        assert world.rt is not None
        world.rt.abort([rid])  # ...and its notice closes the call's connection
        return Outcome(Kind.RETRY, error="connection closed", category="TRANSPORT")

    world.sends["r1"] = cancelled_while_sent
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.IGNORED, after_return=False)
    assert world.store.rows["r1"].result == {"id": "r1", "error_code": "CANCELLED"}
    assert [e for e in world.events if e == "task-revoked"] == ["task-revoked"]
    assert world.gate.of(holder("r1", "t1")) == ["take", "release"]  # its finish fenced off
    released_once(world.gate, holder("r1", "t1"))


def test_a_stale_start_gives_back_what_its_round_trip_took(world: World) -> None:
    world.use(BatchedGate())
    world.store.add("r1", "t2")  # the message's token t1 is not the request's any more
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.IGNORED, after_return=False)
    assert world.store.rows["r1"].result is None  # the newer attempt's to write
    assert world.gate.of(holder("r1", "t1")) == ["take", "release"]
    released_once(world.gate, holder("r1", "t1"))


def test_an_unreadable_record_ends_invalid_and_releases_once(world: World) -> None:
    world.use(BatchedGate())
    world.store.add("r1", "t1", metadata="[not an object")
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.IGNORED, after_return=False)
    assert world.store.rows["r1"].result is not None
    assert world.store.rows["r1"].result["error_code"] == "INVALID_REQUEST"
    assert world.gate.of(holder("r1", "t1")) == ["take", "release", "result"]
    released_once(world.gate, holder("r1", "t1"))


def test_a_tenant_mismatch_gives_back_the_start_s_take_and_asks_again(world: World) -> None:
    world.use(BatchedGate())
    world.store.add("r1", "t1", metadata=json.dumps({"tenant": "b"}))
    traced = world.trace("r1", "t1", tenant={"tenant": "a"})  # the dispatcher named "a"
    assert traced == Traced(states.SUCCESS, after_return=True)
    assert world.gate.of(holder("r1", "t1")) == ["take", "release", "take", "release", "result"]
    released_once(world.gate, holder("r1", "t1"))


def test_an_exception_in_the_body_is_a_counted_retry(world: World) -> None:
    """An exception in the body (here, building its finish) is the attempt's outcome (issue 48:
    4): released, then back to its queue after the backoff with the attempt counted (RETRY),
    never a FAILURE that after_return requeues at once, uncounted (a hot loop when it recurs)."""
    world.store.add("r1", "t1")
    world.store.broken_finish = RuntimeError("a bug in the finish")
    traced = world.trace("r1", "t1")
    assert traced == Traced(states.RETRY, after_return=False)
    assert world.gate.of(holder("r1", "t1")) == ["take", "release", "requeued"]
    (requeue,) = world.store.rows["r1"].requeues
    assert requeue["attempted"] and requeue["delay"] > 0, requeue
    assert "RuntimeError: a bug in the finish" in requeue["last_error"]
    released_once(world.gate, holder("r1", "t1"))


def test_an_exception_around_the_attempt_is_a_counted_retry_by_after_return(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception raised around the attempt in its process (its run never reported): the
    ``finally`` of ``InferenceTask.run`` releases it, and after_return gives it the same
    outcome, counted, backed off."""
    import tasks.inference as inference

    def broken(attempt: Any) -> Any:
        raise RuntimeError("a bug around the attempt")

    monkeypatch.setattr(inference.observe, "observed_run", broken)
    world.store.add("r1", "t1")
    assert world.trace("r1", "t1") == Traced(states.FAILURE, after_return=True)
    assert world.gate.of(holder("r1", "t1")) == ["take", "release", "requeued"]
    (requeue,) = world.store.rows["r1"].requeues
    assert requeue["attempted"] and requeue["delay"] > 0, requeue
    released_once(world.gate, holder("r1", "t1"))


def a_and_b(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> tuple[HandOverGate, ContractRuntime, threading.Thread, dict[str, Traced]]:
    """A hand-over's two attempts of one process: requests ``a`` and ``b`` behind a gate that
    hands its slot over, and B's attempt as a thread not started yet (it parks behind A once
    started), which records how it was traced under ``"b"``."""
    monkeypatch.setattr(attempt_module, "PARK_POLL_S", 60.0)  # B waits only for the hand-over
    gate = HandOverGate()
    rt = world.use(gate, PIPELINE_PARK_S="60")
    world.store.add("a", "ta")
    world.store.add("b", "tb")
    traced: dict[str, Traced] = {}
    b = threading.Thread(target=lambda: traced.setdefault("b", world.trace("b", "tb")))
    return gate, rt, b, traced


def test_a_hand_over_with_a_lapsed_lease_still_ends_in_one_release_each(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A (holding the one slot) finishes while B is parked for it in the same process: A hands
    B its slot, but A's lease lapsed and C took the slot meanwhile, so the transfer finds the
    gate full. A's slot is gone with its hand-over; B, granted, runs holding nothing and
    releases once (a no-op); the gate ends empty once C is done."""
    gate, rt, b, traced = a_and_b(world, monkeypatch)

    def while_a_is_sent(rid: str, token: str) -> Outcome:
        b.start()
        poll(lambda: rt.bell.waiting(QUEUE) == 1)  # B parked behind A
        gate.lapse(holder("a", "ta"))
        gate.acquire(context("c", "tc"))  # C, of another node, took the slot
        return ok(rid, token)

    world.sends["a"] = while_a_is_sent
    with caplog.at_level(logging.WARNING, logger="pipeline.worker"):
        traced["a"] = world.trace("a", "ta")
        b.join(BOUND_S)
    assert not b.is_alive()
    assert traced["a"].state == traced["b"].state == states.SUCCESS
    assert "its lease had lapsed and the gate is full" in caplog.text
    assert gate.of(holder("a", "ta")) == ["take", "lapsed", "handed", "result"]
    assert gate.of(holder("b", "tb")) == ["refused", "release", "result"]
    gate.release(holder("c", "tc"))
    released_once(gate, holder("a", "ta"), holder("b", "tb"), holder("c", "tc"))


def test_a_hand_over_gives_the_slot_to_the_parked_attempt(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, rt, b, _ = a_and_b(world, monkeypatch)

    def while_a_is_sent(rid: str, token: str) -> Outcome:
        b.start()
        poll(lambda: rt.bell.waiting(QUEUE) == 1)
        return ok(rid, token)

    world.sends["a"] = while_a_is_sent
    world.trace("a", "ta")
    b.join(BOUND_S)
    assert gate.of(holder("a", "ta")) == ["take", "handed", "result"]
    assert gate.of(holder("b", "tb")) == ["refused", "take", "release", "result"]
    released_once(gate, holder("a", "ta"), holder("b", "tb"))


def test_a_release_that_fails_four_times_is_left_to_the_lease(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(
        reservation_module, "time", SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)
    )
    world.store.add("r1", "t1")
    world.gate.failing_releases = 4
    with caplog.at_level(logging.WARNING, logger="pipeline.worker"):
        traced = world.trace("r1", "t1")
    assert traced == Traced(states.SUCCESS, after_return=True)  # the result is written anyway
    tries = world.gate.of(holder("r1", "t1"))  # four tries; no fifth, none by after_return
    assert tries == ["take", "release", "release", "release", "release", "result"]
    assert slept == [0.1, 0.2, 0.4, 0.8]
    assert "gave up; its lease will expire" in caplog.text
    assert world.gate.held == {holder("r1", "t1")}  # until its lease lapses:
    world.gate.lapse(holder("r1", "t1"))  # the reaper frees it
    assert world.gate.held == set()


def test_a_finish_that_cannot_be_built_hands_over_all_the_same(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's finish raises as it is built, after A chose B (parked for its slot) as its taker:
    the slot still goes to B, and A's exit releases nothing more."""
    gate, rt, b, traced = a_and_b(world, monkeypatch)

    def while_a_is_sent(rid: str, token: str) -> Outcome:
        b.start()
        poll(lambda: rt.bell.waiting(QUEUE) == 1)
        world.store.broken_finish = RuntimeError("a bug in the finish")
        return ok(rid, token)

    world.sends["a"] = while_a_is_sent
    traced["a"] = world.trace("a", "ta")
    b.join(BOUND_S)
    assert not b.is_alive()
    assert traced["b"].state == states.SUCCESS
    assert gate.of(holder("a", "ta"))[:2] == ["take", "handed"]
    assert "release" not in gate.of(holder("a", "ta"))
    assert gate.of(holder("b", "tb")) == ["refused", "take", "release", "result"]
    released_once(gate, holder("a", "ta"), holder("b", "tb"))


# --------------------------------------------------------------------------- helpers


def context(rid: str, token: str) -> AcquireContext:
    return AcquireContext(rid, token, QUEUE, "elsewhere", 30.0, time.time() + 300)


def poll(done: Callable[[], bool]) -> None:
    end = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < end, "the other attempt never got there"
        time.sleep(0.005)
