"""Look-ahead dispatch and parked attempts: the dispatcher sends a few attempts past a slot
gate's capacity; they park at the worker and take a released slot without going back to the
queue, never putting more than the limit at the model server."""

from __future__ import annotations

import uuid
from typing import Any

from pipeline.client import Pipeline
from pipeline.config import Settings
from pipeline.sim import SimServer

from .conftest import assert_idle, wait_for


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def dispatches(pl: Pipeline, rid: str) -> int:
    return int(pl.record(rid).get("dispatches", 0))


def hold(pl: Pipeline, queue: str, latency_ms: int) -> str:
    rid = pl.submit(
        {"p": "holder"},
        id=uid("hold"),
        queue=queue,
        timeout=60,
        headers={"x-sim-latency-ms": str(latency_ms)},
    ).id
    wait_for(lambda: pl.state(rid) == "running", 10, what="the slot holder")
    return rid


def test_a_request_dispatched_ahead_parks_and_takes_the_released_slot(
    served: Pipeline, sim: SimServer
) -> None:
    sim.reset()
    first = hold(served, "lim1", 1500)
    second = served.submit({"p": "ahead"}, id=uid("ahead"), queue="lim1", timeout=60).id
    # dispatched past the full gate (look-ahead 1 for limit 1) and started: parked, not queued
    wait_for(lambda: served.state(second) == "running", 10, what="the parked attempt")
    assert served.state(first) == "running"  # still holding the only slot
    assert served.inspect()["lim1"]["gate"]["in_flight"] == 1
    assert served.wait(first, 20).ok
    res = served.wait(second, 20)
    assert res.ok and res.attempts == 1
    assert dispatches(served, second) == 1  # admitted by its first dispatch: never requeued
    assert sim.stats()["max_concurrency_observed"] == 1
    assert_idle(served)


def test_a_parked_attempt_that_waits_too_long_goes_back_to_the_queue(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    worker = start_worker(pools="parked", concurrency=4, extra_env={"PIPELINE_PARK_S": "0.3"})
    try:
        sim.reset()
        first = hold(pl, "parked", 2000)
        second = pl.submit({"p": "impatient"}, id=uid("park"), queue="parked", timeout=60).id
        # parks 0.3 s, is refused and goes back (a refusal, not an attempt), then comes again
        wait_for(lambda: dispatches(pl, second) >= 2, 10, what="the parked attempt requeued")
        assert pl.wait(first, 20).ok
        res = pl.wait(second, 20)
        assert res.ok and res.attempts == 1
        assert sim.stats()["max_concurrency_observed"] == 1
        assert_idle(pl)
    finally:
        worker.stop()


def test_lookahead_per_capacity() -> None:
    auto = Settings()
    assert [auto.lookahead_for(c) for c in (1, 2, 4, 5, 16, 32, 33, 1000)] == [
        1,
        1,
        1,
        2,
        4,
        8,
        8,
        8,
    ]
    assert Settings(lookahead=3).lookahead_for(100) == 3
    assert Settings(lookahead=0).lookahead_for(16) == 0
    assert Settings(park_s=0).lookahead_for(16) == 0  # nothing may park: nothing goes ahead


def test_a_warm_shutdown_sends_parked_attempts_back_to_the_queue(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    worker = start_worker(pools="parked", concurrency=4, extra_env={"PIPELINE_PARK_S": "60"})
    first = hold(pl, "parked", 2500)
    second = pl.submit({"p": "parked"}, id=uid("park"), queue="parked", timeout=60).id
    wait_for(lambda: pl.state(second) == "running", 10, what="the parked attempt")
    worker.proc.terminate()  # warm shutdown: the holder finishes, the parked one goes back
    # without the bell closing, the parked attempt would hold the node up for 60 s
    wait_for(lambda: worker.proc.poll() is not None, 20, what="the node to stop")
    assert pl.wait(first, 5).ok
    assert pl.state(second) in ("queued", "retry_wait")
    replacement = start_worker(pools="parked", concurrency=4)
    try:
        res = pl.wait(second, 20)
        assert res.ok and res.attempts == 1
        assert_idle(pl)
    finally:
        replacement.stop()


def test_a_global_limit_holds_across_nodes_and_a_release_on_one_wakes_a_parked_attempt_on_another(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    """``global-max-concurrency`` 2 on two nodes: never more than 2 at the server; attempts
    parked on either node take slots freed on either (the release bell over Pub/Sub)."""
    nodes = [start_worker(pools="global", concurrency=4) for _ in range(2)]
    try:
        sim.reset()
        ids = [
            pl.submit(
                {"p": i},
                id=uid("global"),
                queue="global2",
                timeout=60,
                headers={"x-sim-latency-ms": "150"},
            ).id
            for i in range(10)
        ]
        results = [pl.wait(rid, 30) for rid in ids]
        assert all(r.ok and r.attempts == 1 for r in results)
        assert sim.stats()["max_concurrency_observed"] == 2
        workers = {pl.record(rid).get("worker") for rid in ids}
        assert workers == {n.name for n in nodes}  # both nodes served some
        # parked attempts were admitted by a release, not by going back to the queue
        assert sum(dispatches(pl, rid) for rid in ids) == len(ids)
        assert_idle(pl)
    finally:
        for n in nodes:
            n.stop()
