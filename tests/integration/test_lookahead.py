"""Look-ahead dispatch and parked attempts: the dispatcher sends a few attempts past a slot
gate's capacity; they park at the worker and take a released slot without going back to the
queue, never putting more than the limit at the model server."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import Settings
from pipeline.dispatch.dispatcher import Dispatcher
from pipeline.sim import SimServer
from tests.conftest import assert_idle, held, quota_key, tenants_gate
from tests.conftest import quota as quota_gate

from .sched_harness import bench


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def dispatches(pl: Pipeline, rid: str) -> int:
    return int(pl.record(rid).get("dispatches", 0))


def hold(pl: Pipeline, sim: SimServer, queue: str) -> str:
    """Submit a request that holds the queue's slot at the simulator until the test calls
    ``sim.release(<its id>)``; returns its id once it is held."""
    rid = uid("hold")
    pl.submit({"p": "holder"}, id=rid, queue=queue, timeout=60, headers=held(rid))
    sim.wait_held(rid)
    return rid


def parked_behind_a_holder(pl: Pipeline, sim: SimServer) -> tuple[str, str]:
    """On ``lim1`` (limit 1, look-ahead 1): a request holding the slot at the simulator, and
    one dispatched past the full gate and started: parked at its worker, not queued."""
    sim.reset()
    first = hold(pl, sim, "lim1")
    second = pl.submit({"p": "ahead"}, id=uid("ahead"), queue="lim1", timeout=60).id
    wait_until(lambda: pl.state(second) == "running", 10, "the parked attempt")
    return first, second


def test_a_request_dispatched_ahead_parks_and_takes_the_released_slot(
    served: Pipeline, sim: SimServer
) -> None:
    first, second = parked_behind_a_holder(served, sim)
    assert served.state(first) == "running"  # still holding the only slot
    assert served.inspect()["lim1"]["gate"]["in_flight"] == 1
    assert sim.stats()["attempts_by_request_id"].get(second) is None  # not at the server
    sim.release(first)
    assert served.wait(first, 20).ok
    res = served.wait(second, 20)
    assert res.ok and res.attempts == 1
    assert dispatches(served, second) == 1  # admitted by its first dispatch: never requeued
    assert sim.stats()["max_concurrency_observed"] == 1
    assert_idle(served)


def test_a_parked_attempt_cancelled_ends_unsent_and_its_slot_goes_on(
    served: Pipeline, sim: SimServer
) -> None:
    first, second = parked_behind_a_holder(served, sim)
    third = served.submit({"p": "behind"}, id=uid("behind"), queue="lim1", timeout=60).id
    assert served.cancel(second) is False  # started (parked at its worker): not ended here
    # the cancel notice wakes the parked attempt: it ends unsent without waiting for the slot
    res = served.wait(second, 20)
    assert res.error_code == "CANCELLED" and res.attempts == 0
    assert served.state(first) == "running"  # still holding the slot
    sim.release(first)
    assert served.wait(first, 20).ok
    assert served.wait(third, 20).ok  # dispatched ahead in its place, it ran
    seen = sim.stats()["attempts_by_request_id"]
    assert second not in seen and seen[first] == 1 and seen[third] == 1
    events = [e.event for e in served.explain(second).log]
    assert events[-2:] == ["cancelled", "done"]
    assert_idle(served)


def test_a_parked_attempt_that_waits_too_long_goes_back_to_the_queue(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    worker = start_worker(pools="parked", concurrency=4, extra_env={"PIPELINE_PARK_S": "0.3"})
    try:
        sim.reset()
        first = hold(pl, sim, "parked")
        second = pl.submit({"p": "impatient"}, id=uid("park"), queue="parked", timeout=60).id
        # parks 0.3 s, is refused and goes back (a refusal, not an attempt), then comes again
        wait_until(lambda: dispatches(pl, second) >= 2, 10, "the parked attempt requeued")
        sim.release(first)
        assert pl.wait(first, 20).ok
        res = pl.wait(second, 20)
        assert res.ok and res.attempts == 1
        assert sim.stats()["max_concurrency_observed"] == 1
        assert_idle(pl)
    finally:
        worker.stop()


def test_lookahead_per_capacity() -> None:
    auto = Settings()
    caps = (1, 2, 4, 5, 16, 32, 33, 1000)
    # past a slot gate (alone or behind per-key quotas) or a quota key: half, 1-8
    assert [auto.lookahead_for(c) for c in caps] == [1, 1, 2, 3, 8, 8, 8, 8]
    assert Settings(lookahead=3).lookahead_for(100) == 3
    assert Settings(lookahead=0).lookahead_for(16) == 0
    assert Settings(park_s=0).lookahead_for(16) == 0  # nothing may park: nothing goes ahead


def test_a_quota_key_gets_half_its_limit_dispatched_past_it_by_default(
    served: Pipeline, sim: SimServer
) -> None:
    """quota4 (redis-quota, four in flight per user; look-ahead automatic): with the user's
    four requests held at the simulator, two more are sent past the key's limit and park at
    the worker (half the limit: a tick tops them up after two leaves, not after each one); the
    rest wait in the queue, the tenant held back. Then all of them run, never more than four
    at once."""
    sim.reset()
    user = {"userid": uid("u")}
    holders = [uid("hold") for _ in range(4)]
    for h in holders:
        served.submit({"p": "holder"}, id=h, queue="quota4", timeout=60, metadata=user,
                      headers=held(h))  # fmt: skip
    for h in holders:
        sim.wait_held(h)
    more = [
        served.submit({"p": n}, id=uid("m"), queue="quota4", timeout=60, metadata=user).id
        for n in range(4)
    ]
    wait_until(
        lambda: all(parked_entries(served, r) for r in more[:2]),
        10,
        "two attempts parked past the key's limit",
    )
    # settled until a holder leaves: the key counts 4 + 2, its limit plus its look-ahead
    assert [served.state(r) for r in more[2:]] == ["queued", "queued"]
    assert all(r not in sim.stats()["attempts_by_request_id"] for r in more)
    for h in holders:
        sim.release(h)
    results = [served.wait(r, 20) for r in holders + more]
    assert all(r.ok and r.attempts == 1 for r in results)
    assert sim.stats()["max_concurrency_observed"] == 4
    assert_idle(served)


def test_a_warm_shutdown_sends_parked_attempts_back_to_the_queue(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    worker = start_worker(pools="parked", concurrency=4, extra_env={"PIPELINE_PARK_S": "60"})
    first = hold(pl, sim, "parked")
    second = pl.submit({"p": "parked"}, id=uid("park"), queue="parked", timeout=60).id
    wait_until(lambda: pl.state(second) == "running", 10, "the parked attempt")
    worker.proc.terminate()  # warm shutdown: the holder finishes, the parked one goes back
    # without the bell closing, the parked attempt would hold the node up for 60 s
    wait_until(
        lambda: pl.state(second) in ("queued", "retry_wait"),
        20,
        "the parked attempt back in its queue while the holder still runs",
    )
    assert pl.state(first) == "running" and worker.proc.poll() is None
    sim.release(first)
    wait_until(lambda: worker.proc.poll() is not None, 20, "the node to stop")
    assert pl.wait(first, 5).ok
    assert pl.state(second) in ("queued", "retry_wait")
    replacement = start_worker(pools="parked", concurrency=4)
    try:
        res = pl.wait(second, 20)
        assert res.ok and res.attempts == 1
        assert_idle(pl)
    finally:
        replacement.stop()


def parked_entries(pl: Pipeline, rid: str) -> list[dict[str, Any]]:
    return [e.fields for e in pl.explain(rid).log if e.event == "parked"]


def test_an_attempt_that_finds_others_parked_parks_behind_them_without_asking(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    """parked (limit 1), look-ahead 2: the second attempt dispatched past the full gate finds
    the first parked on its worker and parks behind it without asking the gate (its decision
    log says behind 1); the slot goes to them in dispatch order, one at a time."""
    worker = start_worker(pools="parked", concurrency=4, extra_env={"PIPELINE_LOOKAHEAD": "2"})
    try:
        holder = hold(pl, sim, "parked")
        first = uid("a")  # held at the simulator too once admitted: the order is checked
        pl.submit({"p": "a"}, id=first, queue="parked", timeout=60, headers=held(first))
        # its park noted in the log (after PARK_POLL_S): it waits on the bell now
        wait_until(lambda: parked_entries(pl, first), 10, "the first attempt parked")
        second = pl.submit({"p": "b"}, id=uid("b"), queue="parked", timeout=60).id
        wait_until(lambda: parked_entries(pl, second), 10, "the second attempt parked")
        assert "behind" not in parked_entries(pl, first)[0]  # it asked the gate
        assert parked_entries(pl, second)[0]["behind"] == 1
        assert pl.explain(second).to_text().count("behind 1 parked on its worker") == 1
        assert pl.inspect()["parked"]["gate"]["in_flight"] == 1  # the holder's only
        sim.release(holder)
        sim.wait_held(first)  # the slot went to the attempt parked first
        assert second not in sim.stats()["attempts_by_request_id"]
        sim.release(first)
        results = [pl.wait(r, 20) for r in (holder, first, second)]
        assert all(r.ok and r.attempts == 1 for r in results)
        assert dispatches(pl, first) == dispatches(pl, second) == 1
        assert sim.stats()["max_concurrency_observed"] == 1
        assert_idle(pl)
    finally:
        worker.stop()


def test_an_attempt_that_finds_others_parked_on_its_quota_key_parks_behind_them_without_asking(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    """qrefuse (redis-quota, one in flight per user), look-ahead 2: the user's first request
    holds the key's slot at the simulator; of the two dispatched past the limit, the first asks
    the gate and parks on the key's bell, the second finds it parked there and parks behind it
    without asking (behind 1); the slot goes to them in dispatch order, one at a time."""
    worker = start_worker(pools="qrefuse", concurrency=4, extra_env={"PIPELINE_LOOKAHEAD": "2"})
    try:
        sim.reset()
        user = {"userid": uid("u")}
        holder = uid("hold")
        pl.submit({"p": "holder"}, id=holder, queue="qrefuse", timeout=60, metadata=user,
                  headers=held(holder))  # fmt: skip
        sim.wait_held(holder)
        first = uid("a")  # held at the simulator too once admitted: the order is checked
        pl.submit({"p": "a"}, id=first, queue="qrefuse", timeout=60, metadata=user,
                  headers=held(first))  # fmt: skip
        wait_until(lambda: parked_entries(pl, first), 10, "the first attempt parked")
        second = pl.submit({"p": "b"}, id=uid("b"), queue="qrefuse", timeout=60, metadata=user)
        wait_until(lambda: parked_entries(pl, second.id), 10, "the second attempt parked")
        key = quota_key("qrefuse", user["userid"])
        (asked,) = parked_entries(pl, first)
        assert asked["key"] == key and asked["reason"] == "quota_exhausted"
        assert "behind" not in asked  # it asked the gate
        (behind,) = parked_entries(pl, second.id)
        assert behind["key"] == key and behind["reason"] == "quota_exhausted"
        assert behind["behind"] == 1
        assert second.explain().to_text().count("behind 1 parked on its worker") == 1
        assert pl.inspect()["qrefuse"]["gate"]["in_flight"] == 1  # the holder's only
        sim.release(holder)
        sim.wait_held(first)  # the key's slot went to the attempt parked first
        assert second.id not in sim.stats()["attempts_by_request_id"]
        sim.release(first)
        results = [pl.wait(r, 20) for r in (holder, first, second.id)]
        assert all(r.ok and r.attempts == 1 for r in results)
        assert dispatches(pl, first) == dispatches(pl, second.id) == 1
        assert sim.stats()["max_concurrency_observed"] == 1
        assert_idle(pl)
    finally:
        worker.stop()


def test_a_global_limit_holds_across_nodes_and_a_release_on_one_wakes_a_parked_attempt_on_another(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    """``global-max-concurrency`` 2 on two nodes: node A (2 slots) holds both slots at the
    server; node B takes the next request (A has no free slot) and parks it; a release on A
    wakes it on B (the release bell over Pub/Sub) — never more than 2 at the server."""
    nodes = [start_worker(pools="global", concurrency=2)]
    try:
        sim.reset()
        holding = uid("hold")
        holders = [
            pl.submit({"p": i}, id=uid("held"), queue="global2", timeout=60, headers=held(holding))
            for i in range(2)
        ]
        sim.wait_held(holding, 2)  # both on A, the only node yet: the global limit is reached
        nodes.append(start_worker(pools="global", concurrency=4))
        parked = pl.submit({"p": "b"}, id=uid("parked"), queue="global2", timeout=60).id
        wait_until(lambda: pl.state(parked) == "running", 10, "the attempt parked on B")
        assert pl.inspect()["global2"]["gate"]["in_flight"] == 2
        assert parked not in sim.stats()["attempts_by_request_id"]  # parked, not at the server
        assert sim.release(holding) == 2
        res = pl.wait(parked, 30)
        assert res.ok and res.attempts == 1
        assert all(pl.wait(r.id, 30).ok for r in holders)
        assert sim.stats()["max_concurrency_observed"] == 2
        assert {pl.record(r.id).get("worker") for r in holders} == {nodes[0].name}
        assert pl.record(parked).get("worker") == nodes[1].name
        # admitted by A's release while parked on B, not by going back to the queue
        assert dispatches(pl, parked) == 1
        assert_idle(pl)
    finally:
        for n in nodes:
            n.stop()


PER_NODE_GATES = {
    # gate, then the requests dispatched of 12 (one tenant) with one node and with three:
    # limit 4 + look-ahead 2 (half the limit) per node
    "global": ({"gate_type": "global-max-concurrency", "gate_params": {"limit": 4}}, 6, 10),
    # quota 4 per user + its look-ahead, half the limit (2), per node
    "quota": (quota_gate(4), 6, 10),
    # a composite of both: the quota's 4 + 2, once in all (its parked attempts hold quota slots)
    "composite": (tenants_gate(4, 8), 6, 6),
}


@pytest.mark.parametrize("kind", sorted(PER_NODE_GATES))
def test_each_live_node_of_the_pool_gets_its_own_look_ahead(redis_url: str, kind: str) -> None:
    """A dispatcher whose pool has three live nodes sends a gate's look-ahead once for each
    (every node keeps its own parked reserve, so a slot released there is handed over there),
    except behind a composite of quotas and a slot gate. Then the requests are cancelled:
    nothing is held."""
    gate, alone, three = PER_NODE_GATES[kind]
    for others, expected in (((), alone), (("n2", "n3"), three)):
        with bench(redis_url, [{"queue_name": "g", **gate}]) as b:
            sent: list[Any] = []
            d = Dispatcher(b.pl.settings, ["p"], node="n1", slots=32, send=sent.extend)
            try:
                d.setup_queues()
                for node in others:
                    b.store.node_beat(node, 32, ["p"], 30.0)
                d._heartbeat()
                assert d.pool_nodes["p"] == 1 + len(others)
                items = [
                    {"payload": {"n": i}, "queue": "g", "metadata": {"userid": "u"}}
                    for i in range(12)
                ]
                reqs = b.pl.submit_many(items)
                d.tick()
                assert len(sent) == expected
                assert b.pl.inspect()["g"]["gate"]["in_flight"] == 0  # none started yet
                for r in reqs:
                    b.pl.cancel(r.id)
                assert_idle(b.pl)
            finally:
                for g in d.gates.values():
                    g.close()
