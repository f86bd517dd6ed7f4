"""Invariant 1, one test per exit path: whatever ends an attempt, its gate reservation is
released, the gate's in-flight count returns to 0 and the request has exactly one terminal
result. Real Redis, real worker nodes (threads and prefork), the simulator over HTTP.

Every test here also runs the ``pl`` fixture's leak check afterwards (all queues drain and no
gate key in Redis still holds a slot).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.client.models import Result
from pipeline.gates import AcquireContext, Calls
from pipeline.sim import SimServer
from pipeline.store import sched
from pipeline.worker import AttemptId, Runtime, process, reservation
from tasks.app import celery_queue
from tests.conftest import (
    assert_idle,
    freed_listener,
    give_up_after,
    held,
    moved_to_pool,
    published,
    quota_key,
)
from tests.observability import isolated, start_node


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def stall_first(n: int = 1) -> dict[str, str]:
    return {"x-sim-fail-first": str(n), "x-sim-fail-mode": "stall"}


def results_pushed(pl: Pipeline, queue: str, rid: str) -> list[dict[str, Any]]:
    keys = pl.store_of(queue).keys
    raw = pl.store.client.lrange(keys.result_list(pl.settings.queues[queue]), 0, -1)
    return [r for r in (json.loads(x) for x in raw) if r["id"] == rid]


def gate_in_flight(pl: Pipeline, queue: str) -> int:
    return int(pl.inspect()[queue]["gate"]["in_flight"])


def finished(pl: Pipeline, queue: str, rid: str, timeout: float = 20) -> Result:
    """The request's single terminal result, after its gate is back to 0 in flight."""
    res = pl.wait(rid, timeout)
    wait_until(lambda: gate_in_flight(pl, queue) == 0, 10, f"{queue} gate released")
    assert len(results_pushed(pl, queue, rid)) == 1, "exactly one terminal result"
    return res


def wait_running(pl: Pipeline, rid: str, timeout: float = 10) -> None:
    wait_until(lambda: pl.state(rid) == "running", timeout, f"{rid} running")


def sim_attempts(sim: SimServer, rid: str) -> int:
    return int(sim.stats()["attempts_by_request_id"].get(rid, 0))


# -- outcomes of the HTTP call -----------------------------------------------------------
def test_success(served: Pipeline) -> None:
    rid = served.submit({"p": 1}, id=uid("ok"), queue="lim2", timeout=30).id
    assert finished(served, "lim2", rid).ok


def test_terminal_4xx(served: Pipeline) -> None:
    rid = served.submit(
        {"p": 1},
        id=uid("4xx"),
        queue="lim2",
        timeout=30,
        headers={"x-sim-fail-first": "9", "x-sim-fail-status": "422"},
    ).id
    res = finished(served, "lim2", rid)
    assert res.status_code == 422 and res.attempts == 1


def test_retried_503(served: Pipeline) -> None:
    rid = served.submit(
        {"p": 1},
        id=uid("503"),
        queue="lim2",
        timeout=30,
        headers={"x-sim-fail-first": "2", "x-sim-fail-status": "503"},
    ).id
    res = finished(served, "lim2", rid)
    assert res.ok and res.attempts == 3


def test_429_with_retry_after(served: Pipeline) -> None:
    rid = served.submit(
        {"p": 1},
        id=uid("429"),
        queue="lim2",
        timeout=30,
        headers={"x-sim-fail-first": "1", "x-sim-fail-status": "429", "x-sim-retry-after": "1"},
    ).id
    res = finished(served, "lim2", rid)
    assert res.ok and res.attempts == 2


def test_connection_error(served: Pipeline) -> None:
    rid = served.submit({"p": 1}, id=uid("conn"), queue="dead", timeout=1.0).id
    res = finished(served, "dead", rid)
    assert res.error_code == "DEADLINE_EXCEEDED" and res.attempts >= 2
    assert "ConnectionRefusedError" in (res.error_message or "")


# -- gate verdicts -----------------------------------------------------------------------
def hold_slot(pl: Pipeline, sim: SimServer, queue: str, user: dict[str, str]) -> str:
    """Submit a request that takes ``user``'s only quota slot and is held at the simulator
    until ``sim.release(<its id>)``; returns its id once it is held."""
    rid = uid("holder")
    pl.submit({"p": 1}, id=rid, queue=queue, timeout=30, metadata=user, headers=held(rid))
    sim.wait_held(rid)
    return rid


def dispatches(pl: Pipeline, rid: str) -> int:
    return int(pl.record(rid).get("dispatches", 0))


def test_over_quota_parks_for_its_key(served: Pipeline, sim: SimServer) -> None:
    """quota1 (concurrency 1 per user): a second request of the user is sent past the limit
    (quota look-ahead), is refused, holds nothing and parks for a release of its key; it takes
    the slot when the first request's attempt ends, without going back to the queue."""
    user = {"userid": uid("u")}
    first = hold_slot(served, sim, "quota1", user)
    second = served.submit({"p": 2}, id=uid("parked"), queue="quota1", timeout=30, metadata=user).id
    wait_running(served, second)  # started and parked at the worker
    assert sim_attempts(sim, second) == 0
    sim.release(first)
    assert finished(served, "quota1", first).ok
    res = finished(served, "quota1", second)
    assert res.ok and res.attempts == 1
    assert dispatches(served, second) == 1  # admitted by its first dispatch


def test_gate_refuse(pl: Pipeline, sim: SimServer, start_worker: Any) -> None:
    """A refusal (a look-ahead attempt parked past ``PIPELINE_PARK_S``) holds nothing, goes
    back to the queue and is dispatched again; a refusal is not an attempt."""
    worker = start_worker(pools="qrefuse", concurrency=4, extra_env={"PIPELINE_PARK_S": "0.3"})
    try:
        user = {"userid": uid("u")}
        first = hold_slot(pl, sim, "qrefuse", user)
        second = pl.submit(
            {"p": 2}, id=uid("refused"), queue="qrefuse", timeout=30, metadata=user
        ).id
        wait_until(lambda: dispatches(pl, second) >= 2, 10, "a refusal and a new dispatch")
        assert sim_attempts(sim, second) == 0  # refused attempts never reach the server
        sim.release(first)
        assert finished(pl, "qrefuse", first).ok
        res = finished(pl, "qrefuse", second)
        assert res.ok and res.attempts == 1  # a refusal is not an attempt
    finally:
        worker.stop()


def test_wait_times_out_and_requeues(served: Pipeline, sim: SimServer) -> None:
    user = {"userid": uid("u")}
    first = hold_slot(served, sim, "quotawait", user)
    second = served.submit(
        {"p": 2}, id=uid("waiter"), queue="quotawait", timeout=30, metadata=user
    ).id
    # parks on the gate, times out after PIPELINE_GATE_WAIT_TIMEOUT_S=1 and is requeued
    wait_until(lambda: dispatches(served, second) >= 2, 10, "requeue after the wait timed out")
    assert sim_attempts(sim, second) == 0
    sim.release(first)
    assert finished(served, "quotawait", first).ok
    res = finished(served, "quotawait", second)
    assert res.ok and res.attempts == 1


def test_deadline_passes_while_waiting(served: Pipeline, sim: SimServer) -> None:
    user = {"userid": uid("u")}
    first = hold_slot(served, sim, "quotawait", user)
    second = served.submit(
        {"p": 2}, id=uid("late"), queue="quotawait", timeout=0.8, metadata=user
    ).id
    res = served.wait(second, 20)  # the slot stays held: the deadline passes while it waits
    assert res.error_code == "DEADLINE_EXCEEDED" and res.attempts == 0
    assert sim_attempts(sim, second) == 0
    sim.release(first)
    assert finished(served, "quotawait", second) == res
    assert finished(served, "quotawait", first).ok


# -- ends that are not the task's own ----------------------------------------------------
def test_cancel_at_start(in_process: Pipeline, sim: SimServer) -> None:
    """Cancelled after dispatch, before the attempt starts: the message is fenced off (sent to
    the in-process node's Celery queue)."""
    import tasks

    served = in_process
    q = served.settings.queues["crash"]  # no worker serves this pool now: we dispatch by hand
    rid = served.submit({"p": 1}, id=uid("cancel"), queue="crash", timeout=30).id
    moved = served.store_of(q.queue_name).tick(q, [q], 1.0, -1, 10).moved
    assert [d.id for d in moved] == [rid] and served.state(rid) == "dispatched"
    assert served.cancel(rid)
    tasks.infer.apply_async(
        args=(rid, moved[0].token),
        kwargs={"queue": "crash"},
        task_id=rid,
        queue=celery_queue("inproc"),
    )
    # a request sent after it through the same Celery queue completes after it was handled
    after = served.submit({"p": 2}, id=uid("after"), queue="inproc", timeout=30).id
    assert finished(served, "inproc", after).ok
    res = finished(served, "crash", rid)
    assert res.error_code == "CANCELLED" and sim_attempts(sim, rid) == 0


def test_revoke_before_the_attempt_starts(
    in_process: Pipeline, sim: SimServer, celery_session_worker: Any
) -> None:
    """Celery's own revoke (``celery control revoke``, Flower's button) of a request whose
    message has not reached a worker yet: the node discards the message, ``task_revoked``
    ends the request CANCELLED, nothing is sent and no slot stays taken."""
    import tasks

    pl = in_process
    rid = uid("revoked")
    node = celery_session_worker.hostname
    replies = tasks.app.control.revoke(rid, destination=[node], reply=True, timeout=10)
    assert [list(r) for r in replies] == [[node]] and rid in str(replies)  # the node has it
    pl.submit({"p": 1}, id=rid, queue="inproc", timeout=30)  # dispatched to the node at once
    res = finished(pl, "inproc", rid)
    assert res.error_code == "CANCELLED" and res.attempts == 0
    assert sim_attempts(sim, rid) == 0
    assert pl.record(rid).get("dispatches") == "1"  # it did reach the node: the node ended it


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.fixture(scope="module")
def prefork(start_worker: Any) -> Any:
    w = start_worker(pools="prefork", concurrency=1, pool_impl="prefork")
    yield w
    w.stop()


def test_revoke_terminate(pl: Pipeline, prefork: Any) -> None:
    import tasks

    rid = pl.submit(
        {"p": 1}, id=uid("revoke"), queue="prefork", timeout=30, headers=stall_first(1)
    ).id
    wait_running(pl, rid)
    wait_until(lambda: gate_in_flight(pl, "prefork") == 1, 5, "reservation held")
    tasks.app.control.revoke(rid, terminate=True, signal="SIGKILL")
    res = finished(pl, "prefork", rid)
    assert res.error_code == "CANCELLED"


def test_sigkill_of_a_pool_child(pl: Pipeline, prefork: Any, sim: SimServer) -> None:
    rid = pl.submit(
        {"p": 1}, id=uid("child"), queue="prefork", timeout=30, headers=stall_first(1)
    ).id
    wait_running(pl, rid)
    wait_until(lambda: sim_attempts(sim, rid) == 1, 5, "first attempt at the server")
    children = wait_until(lambda: _children(prefork.proc.pid), 5, "pool child")
    for child in children:
        os.kill(child, signal.SIGKILL)
    res = finished(pl, "prefork", rid, timeout=30)
    assert res.ok and sim_attempts(sim, rid) == 2


def test_soft_time_limit(pl: Pipeline, start_worker: Any, sim: SimServer) -> None:
    w = start_worker(
        pools="softlim", concurrency=1, pool_impl="prefork", celery_args=["--soft-time-limit", "1"]
    )
    try:
        rid = pl.submit(
            {"p": 1}, id=uid("soft"), queue="softlim", timeout=30, headers=stall_first(1)
        ).id
        res = finished(pl, "softlim", rid, timeout=30)
        assert res.ok and res.attempts == 2 and sim_attempts(sim, rid) == 2
    finally:
        w.stop()


def test_hard_time_limit(pl: Pipeline, start_worker: Any, sim: SimServer) -> None:
    w = start_worker(
        pools="hardlim", concurrency=1, pool_impl="prefork", celery_args=["--time-limit", "1"]
    )
    try:
        rid = pl.submit(
            {"p": 1}, id=uid("hard"), queue="hardlim", timeout=30, headers=stall_first(1)
        ).id
        res = finished(pl, "hardlim", rid, timeout=30)
        assert res.ok and sim_attempts(sim, rid) == 2
    finally:
        w.stop()


def test_sigkill_of_the_worker_node(pl: Pipeline, start_worker: Any, sim: SimServer) -> None:
    """Nothing runs on the dead node: the lease expires and another node's reaper frees
    the reservation and requeues the request, which then completes."""
    w = start_worker(pools="crash", concurrency=4)
    rid = pl.submit(
        {"p": 1},
        id=uid("node"),
        queue="crash",
        timeout=60,
        metadata={"userid": "crash-user"},
        headers=stall_first(1),
    ).id
    wait_running(pl, rid)
    assert gate_in_flight(pl, "crash") == 1
    w.proc.kill()
    w.proc.wait()
    survivor = start_worker(pools="crash", concurrency=4)
    try:
        res = finished(pl, "crash", rid, timeout=30)  # after one lease (3 s) at most
        assert res.ok and sim_attempts(sim, rid) == 2
    finally:
        survivor.stop()


def test_warm_shutdown_with_a_request_in_flight(
    pl: Pipeline, start_worker: Any, sim: SimServer
) -> None:
    w = start_worker(pools="crash", concurrency=4)
    rid = uid("warm")
    pl.submit(
        {"p": 1},
        id=rid,
        queue="crash",
        timeout=60,
        metadata={"userid": "warm-user"},
        headers=held(rid),
    )
    sim.wait_held(rid)
    w.proc.send_signal(signal.SIGTERM)  # warm: the running attempt finishes first
    nodes = pl.store_of("crash").keys.pool_nodes("crash")
    wait_until(lambda: pl.store.client.zscore(nodes, w.name) is None, 20, "shutdown begun")
    assert w.proc.poll() is None and pl.state(rid) == "running"  # waiting for the attempt
    sim.release(rid)
    res = finished(pl, "crash", rid, timeout=30)
    assert res.ok and res.attempts == 1
    assert w.proc.wait(30) is not None


# -- the seed's two failure modes ------------------------------------------------------
def test_retried_request_holds_exactly_one_reservation(served: Pipeline, sim: SimServer) -> None:
    """Accounting drift: dispatched, retried, re-dispatched — one reservation, never two."""
    rid = uid("drift")
    fail_once = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
    served.submit({"p": 1}, id=rid, queue="lim2", timeout=30, headers={**fail_once, **held(rid)})
    sim.wait_held(rid)  # the first attempt got its 503 at once; the second is held
    assert served.record(rid).get("attempts") == "1" and served.state(rid) == "running"
    holders = [h for h in served.inspect()["lim2"]["gate"]["holders"] if h["request_id"] == rid]
    assert len(holders) == 1 and gate_in_flight(served, "lim2") == 1
    sim.release(rid)
    assert finished(served, "lim2", rid).ok


def test_limit_one_never_wedges(served: Pipeline) -> None:
    """Permanent wedge: with limit 1, a request that keeps retrying and 20 others all end."""
    retrier = served.submit(
        {"p": 0},
        id=uid("retrier"),
        queue="lim1",
        timeout=30,
        headers={"x-sim-fail-first": "4", "x-sim-fail-status": "503"},
    ).id
    others = [
        served.submit({"p": i}, id=uid("other"), queue="lim1", timeout=30).id for i in range(20)
    ]
    for rid in [retrier, *others]:
        assert finished(served, "lim1", rid).ok


# -- a slot handed straight to an attempt parked in the same process ---------------------
def holder_of(pl: Pipeline, queue: str, rid: str) -> dict[str, Any] | None:
    return next((h for h in pl.inspect()[queue]["gate"]["holders"] if h["request_id"] == rid), None)


def park_behind(pl: Pipeline, queue: str, tag: str, headers: dict[str, str]) -> str:
    rid = pl.submit({"p": tag}, id=uid(tag), queue=queue, timeout=60, headers=headers).id
    wait_running(pl, rid)  # dispatched ahead and parked: the only slot is held
    return rid


def hold_as(tag: str) -> tuple[str, dict[str, str]]:
    """A hold name and the headers that hold a request under it at the simulator."""
    name = uid(tag)
    return name, held(name)


@pytest.fixture
def lookahead_two(start_worker: Any) -> Iterator[Any]:
    """A node for the "parked" queue (limit 1) that dispatches two attempts past the limit.
    Its attempts park for up to 60 s (not the default 10): one that gave up and went back to
    the queue while a busy machine ran the test would park again behind the other, and the
    slot would be handed over in another order."""
    extra = {"PIPELINE_LOOKAHEAD": "2", "PIPELINE_PARK_S": "60"}
    worker = start_worker(pools="parked", concurrency=4, extra_env=extra)
    yield worker
    worker.stop()


@pytest.mark.usefixtures("lookahead_two")
def test_finish_hands_the_slot_to_a_parked_attempt(pl: Pipeline, sim: SimServer) -> None:
    giving, hold_giver = hold_as("giving")
    taking, hold_taker = hold_as("taking")
    giver = park_behind(pl, "parked", "giver", hold_giver)
    sim.wait_held(giving)
    taker = park_behind(pl, "parked", "taker", hold_taker)  # parked behind the giver
    assert gate_in_flight(pl, "parked") == 1
    sim.release(giving)
    sim.wait_held(taking)  # the taker at the server, in the slot the giver handed over
    wait_until(
        lambda: (holder_of(pl, "parked", taker) or {}).get("handed_over_by") == giver,
        10,
        '(holder_of(pl, "parked", taker) or {}).get("handed_over_by") == giver',
    )
    assert gate_in_flight(pl, "parked") == 1
    sim.release(taking)
    assert finished(pl, "parked", giver).ok
    res = finished(pl, "parked", taker)
    assert res.ok and res.attempts == 1 and pl.record(taker).get("dispatches") == "1"
    assert sim.stats()["max_concurrency_observed"] == 1


@pytest.mark.usefixtures("lookahead_two")
def test_retry_hands_the_slot_to_a_parked_attempt(pl: Pipeline, sim: SimServer) -> None:
    holding_first, hold_first = hold_as("first")
    taking, hold_taker = hold_as("taking")
    first = park_behind(pl, "parked", "first", hold_first)
    sim.wait_held(holding_first)
    retried = park_behind(
        pl, "parked", "retried", {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
    )
    taker = park_behind(pl, "parked", "taker", hold_taker)
    # first -> retried (503: backs off, requeued) -> taker, each slot handed over
    sim.release(holding_first)
    sim.wait_held(taking)
    wait_until(
        lambda: (holder_of(pl, "parked", taker) or {}).get("handed_over_by") == retried,
        10,
        '(holder_of(pl, "parked", taker) or {}).get("handed_over_by") == retried',
    )
    assert gate_in_flight(pl, "parked") == 1
    sim.release(taking)
    for rid in (first, taker):
        assert finished(pl, "parked", rid).ok
    res = finished(pl, "parked", retried)
    assert res.ok and res.attempts == 2
    assert sim.stats()["max_concurrency_observed"] == 1


@pytest.fixture
def prepared(pl: Pipeline) -> Iterator[tuple[Pipeline, Runtime, str]]:
    """A client and an in-process runtime for a local-max-concurrency queue (limit 2) that no
    node serves: the test plays each attempt's start itself."""
    q = moved_to_pool(pl.settings.queues["lim2"], "prepared", "nobody")
    settings = replace(pl.settings, queues={**pl.settings.queues, "prepared": q})
    client, rt = Pipeline(settings), Runtime(settings)
    yield client, rt, "prepared"
    rt.stop()
    assert_idle(client)


def dispatch_one(p: Pipeline, queue: str) -> tuple[str, str]:
    q = p.settings.queues[queue]
    rid = p.submit({"p": 1}, id=uid("prep"), queue=queue).id
    (d,) = p.store_of(q.queue_name).tick(q, [q], 1.0, -1, 10).moved
    return rid, d.token


def holds_one_slot_then_frees_it(p: Pipeline, queue: str, attempt: Any) -> None:
    """The attempt holds the gate's one taken slot, succeeds, and the slot is free again."""
    assert gate_in_flight(p, queue) == 1
    assert attempt.run().status.value == "success"
    assert gate_in_flight(p, queue) == 0


def counted_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the worker's round trips (``run_batch`` calls: an attempt's start, its
    finish / requeue) from now on."""
    sent: list[int] = []
    batch = process.run_batch

    def counted(client: Any, calls: Any) -> list[Any]:
        sent.append(len(calls))
        return batch(client, calls)

    for module in (process, reservation):
        monkeypatch.setattr(module, "run_batch", counted)
    return sent


def test_the_start_and_the_gate_acquire_are_one_round_trip(
    prepared: tuple[Pipeline, Runtime, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attempt begins already admitted (its slot taken in the start's round trip), so
    its task asks the gate no more."""
    p, rt, queue = prepared
    rid, token = dispatch_one(p, queue)
    sent = counted_batches(monkeypatch)
    monkeypatch.setattr(rt.gate(queue), "acquire", None)  # never asked on its own
    attempt = rt.begin(AttemptId(rid, token, queue), "w")
    assert attempt is not None and attempt.decision is not None and attempt.decision.admitted
    assert sent == [2]  # start.lua and gate_lease_acquire.lua, one pipeline
    holds_one_slot_then_frees_it(p, queue, attempt)


def test_a_stale_message_gives_back_the_slot_its_start_took(
    prepared: tuple[Pipeline, Runtime, str],
) -> None:
    """Exit path: the start is fenced off (an old token) after the acquire in its round trip
    took a slot; the slot is released at once. A duplicate of a running attempt's message does
    not release that attempt's slot."""
    p, rt, queue = prepared
    rid, token = dispatch_one(p, queue)
    assert rt.begin(AttemptId(rid, "old-token", queue), "w") is None
    assert gate_in_flight(p, queue) == 0
    attempt = rt.begin(AttemptId(rid, token, queue), "w")
    assert attempt is not None and gate_in_flight(p, queue) == 1
    assert rt.begin(AttemptId(rid, token, queue), "w") is None  # a duplicate: fenced, slot kept
    holds_one_slot_then_frees_it(p, queue, attempt)


def test_an_unreadable_record_gives_back_the_slot_its_start_took(
    prepared: tuple[Pipeline, Runtime, str],
) -> None:
    """Exit path: the record cannot be read after the acquire took a slot: the request ends
    INVALID_REQUEST and the slot is released."""
    p, rt, queue = prepared
    rid, token = dispatch_one(p, queue)
    p.store.client.hset(p.store_of(queue).keys.request(rid), "metadata", "[not an object]")
    assert rt.begin(AttemptId(rid, token, queue), "w") is None
    assert gate_in_flight(p, queue) == 0
    assert p.wait(rid, 5).error_code == "INVALID_REQUEST"


def test_a_server_that_lost_its_scripts_still_starts_attempts(
    prepared: tuple[Pipeline, Runtime, str],
) -> None:
    """NOSCRIPT in the start's round trip (Redis restarted, SCRIPT FLUSH): each call that did
    not run is run again on its own, loading its script."""
    p, rt, queue = prepared
    rid, token = dispatch_one(p, queue)
    rt.store.client.script_flush()
    attempt = rt.begin(AttemptId(rid, token, queue), "w")
    assert attempt is not None and attempt.decision is not None and attempt.decision.admitted
    holds_one_slot_then_frees_it(p, queue, attempt)


QUOTA_PER_USER = {"quota1": 1, "tenants": 2}


@contextlib.contextmanager
def indexed_copy(pl: Pipeline, like: str) -> Iterator[tuple[Pipeline, Runtime, str]]:
    """A copy of queue ``like`` that no node serves, indexed by userid (its dispatched
    messages name the tenant), with a client and an in-process runtime."""
    q = moved_to_pool(pl.settings.queues[like], "ptenant", "nobody")
    settings = replace(pl.settings, queues={**pl.settings.queues, "ptenant": q})
    client, rt = Pipeline(settings), Runtime(settings)
    store = client.store_of("ptenant")
    sched.setup(store.client, store.scripts, store.keys, "ptenant", "nobody", "userid", False)
    try:
        yield client, rt, "ptenant"
    finally:
        rt.stop()
        assert_idle(client)
        sched.teardown(store.client, store.keys, "ptenant")


@pytest.fixture(params=sorted(QUOTA_PER_USER))
def prepared_tenant(
    pl: Pipeline, request: pytest.FixtureRequest
) -> Iterator[tuple[Pipeline, Runtime, str, int]]:
    """As ``prepared``, for an indexed queue (a quota per userid: ``redis-quota`` 1 alone, or
    2 per user in a composite behind a global 6); and the quota per user."""
    with indexed_copy(pl, request.param) as (client, rt, queue):
        yield client, rt, queue, QUOTA_PER_USER[request.param]


def dispatch_tenant(p: Pipeline, queue: str, user: str) -> Any:
    q = p.settings.queues[queue]
    p.submit({"p": 1}, id=uid("ten"), queue=queue, metadata={"userid": user})
    (d,) = p.store_of(q.queue_name).tick(q, [q], 1.0, -1, 10).moved
    assert d.tenant == {"userid": user}
    return d


def test_a_quota_acquire_goes_with_the_start_when_the_message_names_the_tenant(
    prepared_tenant: tuple[Pipeline, Runtime, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher names the request's tenant in its message: the worker sends the quota's
    acquire (and a composite's slot gate's) in the round trip of the start, and the attempt
    begins admitted; a second attempt of the user, past its quota, begins refused on the key
    in the same way. Both end with no reservation held."""
    p, rt, queue, limit = prepared_tenant
    user = uid("u")
    first = dispatch_tenant(p, queue, user)
    sent = counted_batches(monkeypatch)
    gate = rt.gate(queue)
    monkeypatch.setattr(gate, "acquire", None)  # never asked on its own
    a = rt.begin(AttemptId(first.id, first.token, queue, tenant=first.tenant), "w")
    assert a is not None and a.decision is not None and a.decision.admitted
    n_calls = 2 if gate.type_name == "redis-quota" else 3  # start + quota (+ global)
    assert sent == [n_calls]
    assert gate_in_flight(p, queue) == 1
    others = [dispatch_tenant(p, queue, user) for _ in range(limit)]
    begun = [rt.begin(AttemptId(d.id, d.token, queue, tenant=d.tenant), "w") for d in others]
    over = begun[-1]  # past the user's quota: refused on its key, with its start
    assert over is not None and over.decision is not None and not over.decision.admitted
    assert over.decision.wake_key == quota_key("nobody", user)
    assert all(n == n_calls for n in sent)
    monkeypatch.undo()
    for attempt in begun[:-1]:
        assert attempt is not None and attempt.run().status.value == "success"
    assert a.run().status.value == "success"
    assert over.run().status.value == "success"  # admitted once the key had room
    assert gate_in_flight(p, queue) == 0


def test_a_quota_hand_over_goes_in_the_givers_finish_round_trip(
    pl: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-quota 1 per user: the user's second attempt parks on the key; the first one's
    finish hands it the key's slot with the transfer sent ahead of the finish, in one round
    trip (the gate's own transfer is never called); both end, nothing held."""
    with indexed_copy(pl, "quota1") as (p, rt, queue):
        user = uid("u")
        first, second = dispatch_tenant(p, queue, user), dispatch_tenant(p, queue, user)
        a = rt.begin(AttemptId(first.id, first.token, queue, tenant=first.tenant), "w")
        b = rt.begin(AttemptId(second.id, second.token, queue, tenant=second.tenant), "w")
        assert a and b and a.decision and b.decision
        assert a.decision.admitted and not b.decision.admitted
        reports: list[Any] = []
        parked = threading.Thread(target=lambda: reports.append(b.run()))
        parked.start()
        key = quota_key("nobody", user)
        wait_until(lambda: rt.bell.waiting(key) == 1, 5, "the second attempt parked")
        sent = counted_batches(monkeypatch)
        monkeypatch.setattr(Calls, "run", None)  # no gate step on its own (no direct transfer)
        assert a.run().status.value == "success"
        parked.join(10)
        assert reports and reports[0].status.value == "success"
        assert sent[0] == 2  # the transfer, then a's finish
        assert (p.record(second.id).get("log") or "").count('"handed_over":true') == 1


def test_a_composite_hands_its_tenants_slots_to_an_attempt_parked_on_the_key(
    pl: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quota of 2 per user behind a global limit with room: the user's third attempt parks
    on the key; the first one's finish hands it the key's slot and the global's, both sent
    ahead of the finish in one round trip, and publishes no release (nothing was freed for an
    attempt just dispatched to take first). All end; no gate holds a reservation."""
    with indexed_copy(pl, "tenants") as (p, rt, queue):
        user = uid("u")
        ds = [dispatch_tenant(p, queue, user) for _ in range(3)]
        a, b, c = (rt.begin(AttemptId(d.id, d.token, queue, tenant=d.tenant), "w") for d in ds)
        assert a and b and c and a.decision and b.decision and c.decision
        assert a.decision.admitted and b.decision.admitted and not c.decision.admitted
        reports: list[Any] = []
        parked = threading.Thread(target=lambda: reports.append(c.run()))
        parked.start()
        key = quota_key("nobody", user)
        wait_until(lambda: rt.bell.waiting(key) == 1, 5, "the third attempt parked on the key")
        listener = freed_listener(p.store_of(queue))
        sent = counted_batches(monkeypatch)
        monkeypatch.setattr(Calls, "run", None)  # no gate step on its own (no direct transfer)
        assert a.run().status.value == "success"
        parked.join(10)
        monkeypatch.undo()
        assert reports and reports[0].status.value == "success"
        assert sent[0] == 3  # the key's transfer, the global's, then a's finish
        assert (p.record(ds[2].id).get("log") or "").count('"handed_over":true') == 1
        assert b.run().status.value == "success"
        assert gate_in_flight(p, queue) == 0
        released = published(listener, 2, "the releases published")
        assert released == [queue, queue]  # c's and b's releases; none for a's hand-over


def test_a_composite_release_goes_in_the_finish_round_trip(
    pl: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quota per user behind a global limit: the attempt's release on both inner gates is
    sent ahead of its finish, in one round trip (the gate's own release is never called)."""
    with indexed_copy(pl, "tenants") as (p, rt, queue):
        d = dispatch_tenant(p, queue, uid("u"))
        attempt = rt.begin(AttemptId(d.id, d.token, queue, tenant=d.tenant), "w")
        assert attempt and attempt.decision and attempt.decision.admitted
        assert gate_in_flight(p, queue) == 1
        sent = counted_batches(monkeypatch)
        monkeypatch.setattr(rt.gate(queue), "release", None)  # never on its own
        assert attempt.run().status.value == "success"
        assert sent == [3]  # the global's release, the quota's, then the finish
        assert gate_in_flight(p, queue) == 0


def test_a_tenant_the_record_does_not_have_is_not_trusted(
    prepared_tenant: tuple[Pipeline, Runtime, str, int],
) -> None:
    """A message naming another tenant than the request's (written by hand): what its start
    took is given back and the attempt asks its gate as usual, for its own tenant."""
    p, rt, queue, _ = prepared_tenant
    d = dispatch_tenant(p, queue, uid("u"))
    attempt = rt.begin(AttemptId(d.id, d.token, queue, tenant={"userid": "someone-else"}), "w")
    assert attempt is not None and attempt.decision is None
    assert gate_in_flight(p, queue) == 0
    assert attempt.run().status.value == "success"
    assert gate_in_flight(p, queue) == 0


def test_a_hand_over_publishes_no_release(prepared: tuple[Pipeline, Runtime, str]) -> None:
    """A finish that handed its slot to a parked attempt freed nothing, so it publishes
    nothing on the freed channel (every process's release bell would wake for it); finishes
    that release do publish."""
    p, rt, queue = prepared
    a, b, c = (rt.begin(AttemptId(*dispatch_one(p, queue), queue), "w") for _ in range(3))
    assert a and b and c and a.decision and b.decision and c.decision
    assert a.decision.admitted and b.decision.admitted and not c.decision.admitted
    listener = freed_listener(p.store_of(queue))
    reports: list[Any] = []
    parked = threading.Thread(target=lambda: reports.append(c.run()))
    parked.start()
    wait_until(lambda: rt.bell.waiting(queue) == 1, 5, "the third attempt parked")
    assert a.run().status.value == "success"  # hands its slot to c
    parked.join(10)
    assert reports and reports[0].status.value == "success"  # c released: nobody parked
    assert b.run().status.value == "success"
    assert gate_in_flight(p, queue) == 0
    released = published(listener, 2, "the releases published")  # subscribe reply skipped
    assert released == [queue, queue]  # c's and b's releases; none for a's hand-over


def test_a_second_release_frees_nothing_and_hands_nothing_over(
    prepared: tuple[Pipeline, Runtime, str],
) -> None:
    """A reservation's release is idempotent: released once (as an abandon does), it holds
    nothing, so its finish after that frees nothing and hands no slot to an attempt parked
    for one (which would go to the server without a slot): the parked attempt asks again."""
    p, rt, queue = prepared
    a, b, c = (rt.begin(AttemptId(*dispatch_one(p, queue), queue), "w") for _ in range(3))
    assert a and b and c and c.decision is not None and not c.decision.admitted
    b.reservation.release()
    other = AcquireContext("other", "t", queue, "w", 30.0, time.time() + 60)
    assert rt.gate(queue).acquire(other).admitted  # b's slot, taken by someone else
    reports: list[Any] = []
    parked = threading.Thread(target=lambda: reports.append(c.run()))
    parked.start()
    wait_until(lambda: rt.bell.waiting(queue) == 1, 5, "the third attempt parked")
    assert b._error("CANCELLED", "ended after its release").status.value == "failed"
    wait_until(lambda: rt.bell.waiting(queue) == 1, 5, "the third attempt parked again")
    assert not reports and gate_in_flight(p, queue) == 2  # a's and the other's
    rt.gate(queue).release(other.holder)  # the parked attempt finds it at its next ask
    parked.join(10)
    assert reports and reports[0].status.value == "success"
    assert '"handed_over":true' not in (p.record(c.id).get("log") or "")
    assert a.run().status.value == "success"
    assert gate_in_flight(p, queue) == 0


# -- per-key quota slots handed over ------------------------------------------------------
def test_finish_hands_a_quota_slot_to_an_attempt_parked_for_its_key(
    served: Pipeline, sim: SimServer
) -> None:
    """quota1 (1 per user): the user's second request, sent past the limit, parks on the
    user's key; the first one's finish hands it the key's slot (no release, no re-acquire)."""
    user = {"userid": uid("u")}
    giver = hold_slot(served, sim, "quota1", user)
    taker = uid("taker")
    served.submit(
        {"p": 2}, id=taker, queue="quota1", timeout=30, metadata=user, headers=held(taker)
    )
    wait_running(served, taker)  # parked for the key
    sim.release(giver)
    sim.wait_held(taker)  # at the server, with the slot handed over
    # the taker leaves for the server at once; the giver records the transfer meanwhile
    wait_until(
        lambda: (holder_of(served, "quota1", taker) or {}).get("handed_over_by") == giver,
        10,
        '(holder_of(served, "quota1", taker) or {}).get("handed_over_by") == giver',
    )
    sim.release(taker)
    assert finished(served, "quota1", giver).ok
    res = finished(served, "quota1", taker)
    assert res.ok and res.attempts == 1 and dispatches(served, taker) == 1
    assert sim.stats()["max_concurrency_observed"] == 1


def test_a_composite_hands_its_global_slot_to_an_attempt_holding_its_own_quota(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    """tenants: quota 2 per user, then global 6 (one composite). Six held requests of three
    users fill the global limit; a fourth user's request parks on the global gate, keeping its
    own quota slot, and takes a finishing holder's global slot by hand-over."""
    worker = start_worker(pools="tenants", concurrency=16)
    try:
        holders = []
        for i in range(6):
            rid = uid("g")
            pl.submit({"p": i}, id=rid, queue="tenants", timeout=60, headers=held(rid),
                      metadata={"userid": f"u{i // 2}"})  # fmt: skip
            holders.append(rid)
        for rid in holders:
            sim.wait_held(rid)
        taker = uid("taker")
        pl.submit({"p": "t"}, id=taker, queue="tenants", timeout=60, headers=held(taker),
                  metadata={"userid": "u9"})  # fmt: skip
        wait_running(pl, taker)  # dispatched ahead, parked on the global gate
        keys, c = pl.store_of("tenants").keys, pl.store.client
        token = pl.record(taker)["token"]
        quota_holders = keys.gate_holders(quota_key("tenants", "u9"))
        wait_until(lambda: c.zscore(quota_holders, f"{taker}:{token}"), 10, "its own quota")
        # parked on the global gate, not only refused: a finish hands over only to an attempt
        # parked by then (its park is noted once it outlasts PARK_POLL_S)
        wait_until(
            lambda: any(x.event == "parked" for x in pl.explain(taker).log), 10, "the park noted"
        )
        sim.release(holders[0])
        sim.wait_held(taker)
        # the taker leaves for the server at once; the transfer lands with its giver's finish
        info = wait_until(
            lambda: c.hget(keys.gate_info("tenants/1"), f"{taker}:{token}"),
            10,
            "the hand-over recorded",
        )
        assert json.loads(info)["handed_over_by"].rsplit(":", 1)[0] == holders[0]
        for rid in [*holders[1:], taker]:
            sim.release(rid)
        for rid in [*holders, taker]:
            assert finished(pl, "tenants", rid).ok
        assert dispatches(pl, taker) == 1
        assert sim.stats()["max_concurrency_observed"] <= 6
    finally:
        worker.stop()


def test_a_quota_hand_over_publishes_no_release_of_the_key(pl: Pipeline) -> None:
    """In process: two attempts of one user dispatched on a concurrency-1 quota (one past the
    limit, parked on the user's key). The first one's finish hands the key's slot over and
    publishes nothing; the second one's finish releases it and publishes the key (for
    attempts parked on it elsewhere) and the queue."""
    from pipeline.store import MergeArgs, sched

    q = moved_to_pool(pl.settings.queues["quota1"], "qprep", "nobody")
    settings = replace(pl.settings, queues={**pl.settings.queues, "qprep": q})
    client, rt = Pipeline(settings), Runtime(settings)
    try:
        s = client.store_of("qprep")
        sched.setup(s.client, s.scripts, s.keys, "qprep", "nobody", "userid", False)
        specs = tuple(replace(x, lookahead=1) for x in rt.gate("qprep").quota_specs())
        for i in range(2):
            client.submit({"i": i}, id=uid("qh"), queue="qprep", timeout=30,
                          metadata={"userid": "qh-user"})  # fmt: skip
        moved = s.tick_pool(
            "nobody", [s.queue_tick(q, budget=1.0, specs=specs)], 10, merge=MergeArgs(lookahead=4)
        ).moved
        assert len(moved) == 2  # the limit, and one past it
        a, b = (rt.begin(AttemptId(d.id, d.token, "qprep"), "w") for d in moved)
        assert a and b and a.acquire().admitted and not b.acquire().admitted
        listener = freed_listener(s)
        reports: list[Any] = []
        parked = threading.Thread(target=lambda: reports.append(b.run()))
        parked.start()
        wait_until(lambda: rt.bell.waiting(quota_key("nobody", "qh-user")) == 1, 5, "b parked")
        assert a.run().status.value == "success"  # hands the key's slot to b
        parked.join(10)
        assert reports and reports[0].status.value == "success"
        released = published(listener, 1, "b's release published")
        assert released == ["qprep\n" + quota_key("nobody", "qh-user")]  # b's, with its key
        assert not list(s.client.scan_iter(s.keys.prefix + "gate:*:sent", count=10_000))
    finally:
        rt.stop()
    assert_idle(client)


# -- at scale: one node holding hundreds of attempts (issue 46) -----------------------------
WIDE_LIMIT = 250  # the queue's global limit: 350 requests, so 100 wait their turn


def test_hundreds_in_flight_release_on_success_retry_and_abort(
    env: dict[str, str], tmp_path: Path, sim: SimServer, start_worker: Any
) -> None:
    """One node at -c 512 behind a global limit of 250, 350 requests: 100 aborted while their
    calls are held, 150 answered 200 on their first attempt, 100 answered 503 first and
    retried. Never more than the limit at the server, every request one terminal result with
    the attempts its path makes, and every reservation released (``assert_idle``)."""
    gate = {"gate_type": "global-max-concurrency", "gate_params": {"limit": WIDE_LIMIT}}
    iso = isolated(env, tmp_path, [{"queue_name": "wide", "igw_base_url": sim.url, **gate}])
    queue = iso.queue("wide")
    w, _ = start_node(start_worker, iso, concurrency=512)
    sim.reset()
    tag = uuid.uuid4().hex[:6]
    kept, dropped = f"kept-{tag}", f"dropped-{tag}"
    retry = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}

    def batch(kind: str, n: int, hold: str, **headers: str) -> list[str]:
        items = [
            {"payload": {"i": i}, "id": f"{kind}-{tag}-{i}", "queue": queue, "timeout": 600,
             "headers": {**held(hold), **headers}}
            for i in range(n)
        ]  # fmt: skip
        return [r.id for r in iso.pl.submit_many(items)]

    try:
        aborted = batch("abort", 100, dropped)
        sim.wait_held(dropped, 100, timeout_s=60)
        ok = batch("ok", 150, kept)
        retried = batch("retry", 100, kept, **retry)
        sim.wait_held(kept, 150, timeout_s=60)  # the limit reached: the retries wait
        for rid in aborted:
            assert iso.pl.cancel(rid, running="abort")
        sim.wait_held(kept, 250, timeout_s=60)  # their slots went to the retries' 2nd tries
        wait_until(lambda: set(aborted) <= {r for _, r, _ in sim.hangups()}, 20, "hang-ups")
        sim.release(kept)
        results = {
            r.id: r
            for r in iso.pl.iter_results(
                aborted + ok + retried, on_poll=give_up_after(120, "350 results")
            )
        }
    finally:
        sim.release_all()
        w.stop()
    assert all(results[r].error_code == "CANCELLED" for r in aborted)
    assert all(results[r].ok and results[r].attempts == 1 for r in ok)
    assert all(results[r].ok and results[r].attempts == 2 for r in retried)
    pushed = [r["id"] for r in (json.loads(x) for x in iso.pl.store.client.lrange(
        iso.pl.store_of(queue).keys.result_list(iso.settings.queues[queue]), 0, -1))]  # fmt: skip
    assert sorted(pushed) == sorted(results)  # exactly one terminal result each
    assert sim.stats()["max_concurrency_observed"] <= WIDE_LIMIT
    assert {rid for _, rid, _ in sim.hangups()} == set(aborted)  # only the aborted hung up
    assert_idle(iso.pl)
    assert not [ln for ln in w.log.read_text().splitlines() if " ERROR " in ln]
