"""Cancel that stops running work: ``cancel(id, running="abort")`` ends a running request
CANCELLED at once, closes its attempt's connection wherever it runs (the simulator sees the
client hang up, as vLLM would, and stops), never retries it, discards a late answer, and
releases the attempt's gate reservation on every path: one test per path. Real Redis, real
worker nodes (threads and prefork), the simulator over HTTP; every test ends with the ``pl``
fixture's check that no gate holds a reservation."""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.errors import InvalidRequest
from pipeline.sim import SimServer
from pipeline.worker import AttemptId, Runtime, observe
from tests.conftest import moved_to_pool
from tests.integration.test_release_paths import (
    finished,
    gate_in_flight,
    results_pushed,
    sim_attempts,
    stall_first,
)


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def hung_up(sim: SimServer, rid: str) -> bool:
    return any(r == rid for _, r, _ in sim.hangups())


def held(rid: str) -> dict[str, str]:
    """Headers that hold the request's 200 at the simulator until released (or hung up on)."""
    return {"x-sim-hold": rid}


def aborted_mid_call(pl: Pipeline, sim: SimServer, queue: str, tag: str) -> str:
    """Submit a request the simulator holds, wait until its call is there, abort it: the
    call's connection is closed, the request ends CANCELLED with one result, and its slot is
    free. Returns its id."""
    rid = uid(tag)
    pl.submit({"p": 1}, id=rid, queue=queue, timeout=60, headers=held(rid))
    sim.wait_held(rid, 1, timeout_s=20)
    assert pl.cancel(rid, running="abort", by="test-operator") is True
    res = pl.wait(rid, 5)  # written by the cancel itself
    assert res.error_code == "CANCELLED" and "aborted" in (res.error_message or "")
    wait_until(lambda: hung_up(sim, rid), 10, f"{rid}'s connection closed")
    wait_until(lambda: gate_in_flight(pl, queue) == 0, 10, f"{queue} gate released")
    assert sim.release(rid) == 0  # nothing left held: the call is gone
    assert len(results_pushed(pl, queue, rid)) == 1 and pl.wait(rid, 1) == res
    assert sim_attempts(sim, rid) == 1  # never retried
    return rid


def test_abort_mid_call_on_a_threads_node(served: Pipeline, sim: SimServer) -> None:
    rid = aborted_mid_call(served, sim, "lim2", "abort")
    text = served.explain(rid).to_text()
    assert "asked by test-operator while running; its call aborted" in text, text
    # the queue goes on: the next request is served
    after = served.submit({"p": 2}, id=uid("after"), queue="lim2", timeout=30).id
    assert finished(served, "lim2", after).ok


def test_abort_mid_call_in_a_prefork_child(pl: Pipeline, start_worker: Any, sim: SimServer) -> None:
    w = start_worker(pools="prefork", concurrency=1, pool_impl="prefork")
    try:
        aborted_mid_call(pl, sim, "prefork", "fork")
    finally:
        w.stop()


def test_abort_while_parked_for_a_slot(served: Pipeline, sim: SimServer) -> None:
    """Exit path: the attempt waits at its worker for the gate's one slot; the abort ends it
    unsent and the slot's holder is untouched."""
    first, second = uid("holder"), uid("parked")
    served.submit({"p": 1}, id=first, queue="lim1", timeout=60, headers=held(first))
    sim.wait_held(first, 1, timeout_s=20)
    served.submit({"p": 2}, id=second, queue="lim1", timeout=60)
    wait_until(lambda: served.state(second) == "running", 10, "the second attempt parked")
    assert served.cancel(second, running="abort")
    assert served.wait(second, 5).error_code == "CANCELLED"
    assert gate_in_flight(served, "lim1") == 1  # the first still holds its slot
    sim.release(first)
    assert finished(served, "lim1", first).ok
    assert sim_attempts(sim, second) == 0 and not hung_up(sim, second)
    assert len(results_pushed(served, "lim1", second)) == 1


def test_abort_of_a_queued_request_is_a_plain_cancel(pl: Pipeline) -> None:
    q = "solo"  # no worker serves it
    rid = pl.submit({"p": 1}, id=uid("queued"), queue=q, timeout=30).id
    assert pl.cancel(rid, running="abort")
    assert pl.wait(rid, 5).error_code == "CANCELLED"
    assert not pl.cancel(rid, running="abort")  # done: nothing to cancel


def test_finish_keeps_todays_semantics(served: Pipeline, sim: SimServer) -> None:
    """``running="finish"`` (the default): a sent call is not touched and its answer is the
    result."""
    rid = uid("finish")
    served.submit({"p": 1}, id=rid, queue="lim2", timeout=60, headers=held(rid))
    sim.wait_held(rid, 1, timeout_s=20)
    assert served.cancel(rid) is False
    sim.release(rid)
    assert finished(served, "lim2", rid).ok and not hung_up(sim, rid)


def test_running_must_be_finish_or_abort(pl: Pipeline) -> None:
    with pytest.raises(InvalidRequest, match="running"):
        pl.cancel("any", running="kill")
    with pytest.raises(InvalidRequest, match="by"):
        pl.cancel("any", by="x\ny")


# -- an attempt played in-process, to reach the paths a notice races with -------------------
@pytest.fixture
def local(pl: Pipeline) -> Any:
    """A client and an in-process runtime for a local-max-concurrency queue (limit 2) that no
    node serves: the test dispatches and runs the attempt itself."""
    q = moved_to_pool(pl.settings.queues["lim2"], "abortlocal", "nobody")
    settings = replace(pl.settings, queues={**pl.settings.queues, "abortlocal": q})
    client, rt = Pipeline(settings), Runtime(settings)
    yield client, rt, "abortlocal"
    rt.stop()


def begin(p: Pipeline, rt: Runtime, queue: str, headers: dict[str, str] | None = None) -> Any:
    q = p.settings.queues[queue]
    rid = p.submit({"p": 1}, id=uid("local"), queue=queue, timeout=60, headers=headers).id
    (d,) = p.store_of(queue).tick(q, [q], 1.0, -1, 10).moved
    attempt = rt.begin(AttemptId(rid, d.token, queue), "w")
    assert attempt is not None and gate_in_flight(p, queue) == 1
    return attempt


def test_the_answer_came_before_the_abort(
    local: Any, sim: SimServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit path: the 200 is read, then the abort lands before the attempt writes it: the late
    answer is discarded (fenced), the cancel's result stands, the slot is released."""
    p, rt, queue = local
    attempt = begin(p, rt, queue)
    send = observe.observed_send

    def answered_then_cancelled(*args: Any, **kwargs: Any) -> Any:
        outcome = send(*args, **kwargs)
        assert outcome.status_code == 200
        assert p.cancel(attempt.id, running="abort")
        wait_until(lambda: attempt.abort.fired, 10, "the abort notice")
        return outcome

    monkeypatch.setattr(observe, "observed_send", answered_then_cancelled)
    assert attempt.run().status.value == "aborted"
    assert p.wait(attempt.id, 1).error_code == "CANCELLED"
    assert gate_in_flight(p, queue) == 0 and len(results_pushed(p, queue, attempt.id)) == 1


def test_a_lost_notice_is_made_up_by_the_heartbeat(local: Any, sim: SimServer) -> None:
    """Exit path: the abort notice never reaches the node (no listener takes it): the lease
    heartbeat finds the attempt fenced off and closes its call; the slot is released."""
    p, rt, queue = local
    rt.bell.on_abort = None  # notices are heard, but nobody acts on them
    rid = uid("lost")
    attempt = begin(p, rt, queue, held(rid))
    report: list[Any] = []
    runner = threading.Thread(target=lambda: report.append(attempt.run()))
    runner.start()
    sim.wait_held(rid, 1, timeout_s=20)
    assert p.cancel(attempt.id, running="abort")
    wait_until(lambda: hung_up(sim, attempt.id), 10, "the heartbeat closed the call")
    runner.join(10)
    assert report and report[0].status.value == "aborted"
    assert gate_in_flight(p, queue) == 0 and sim_attempts(sim, attempt.id) == 1


def test_a_stalled_call_is_aborted_too(served: Pipeline, sim: SimServer) -> None:
    """A call that never answers (a stalled server) is closed the same way."""
    rid = served.submit(
        {"p": 1}, id=uid("stall"), queue="lim2", timeout=60, headers=stall_first(1)
    ).id
    wait_until(lambda: sim_attempts(sim, rid) == 1, 10, "the call at the simulator")
    assert served.cancel(rid, running="abort")
    wait_until(lambda: hung_up(sim, rid), 10, "the stalled call closed")
    wait_until(lambda: gate_in_flight(served, "lim2") == 0, 10, "lim2 released")
    assert served.wait(rid, 1).error_code == "CANCELLED" and sim_attempts(sim, rid) == 1
