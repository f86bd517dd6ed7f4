"""Quota-aware dispatch, with the real dispatch script: a tenant whose requests dispatched or
running reach its quota key's limit is held back (it holds no worker slot and is not looked at
again) until a request of that key leaves the active state — by any path: finished,
requeued, reaped, cancelled — which makes it ready again, rings its pool's doorbell and
publishes the key so attempts parked for it wake. Plus the set-up of indexed queues."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from pipeline.cli.services import wait_until
from pipeline.gates import AcquireContext, GateEnv, build_gate, wake_keys
from pipeline.store import MergeArgs, sched
from pipeline.store.scripts import run_batch

from .sched_harness import Bench, bench, check_consistent, quota_spec

QUEUES = [{"queue_name": "q"}, {"queue_name": "other", "worker_pool_id": "o"}]
LA = MergeArgs(lookahead=8)


def submit(b: Bench, tenant: str | None, n: int, tag: str, offset: float = 0) -> list[str]:
    now = time.time() + 600 + offset
    items: list[dict[str, Any]] = [
        {"payload": {}, "id": f"{tag}{i}", "queue": "q", "deadline": now + i} for i in range(n)
    ]
    for it in items:
        if tenant is not None:
            it["metadata"] = {"userid": tenant}
    return [r.id for r in b.pl.submit_many(items)]


def tick(b: Bench, free: int, limit: int = 2, la: int = 1) -> list[Any]:
    res = b.tick({"q": {"specs": (quota_spec(limit, la),)}}, free, LA)
    check_consistent(b, "q")
    return list(res.moved)


def sent(b: Bench, tenant: str) -> set[str]:
    return set(b.client.zrange(b.store.keys.quota_sent(f"quota:userid:{tenant}"), 0, -1))


def test_a_tenant_at_its_limit_is_held_back_then_woken_by_a_leave(redis_url: str) -> None:
    with bench(redis_url, QUEUES) as b:
        b.index("q", False)
        a = submit(b, "A", 10, "a")
        bees = submit(b, "B", 2, "b", offset=100)
        pubsub = b.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(b.store.keys.freed_channel())
        wait_until(
            lambda: b.client.pubsub_numsub(b.store.keys.freed_channel())[0][1] >= 1,
            5,
            "b.client.pubsub_numsub(b.store.keys.freed_channel())[0][1] >= 1",
        )
        moved = tick(b, 20)
        # A's first two (its limit), B's two, then one look-ahead attempt of A past its limit
        assert [d.id for d in moved] == [a[0], a[1], *bees, a[2]]
        assert sent(b, "A") == set(a[:3])
        keys = b.store.keys
        assert b.client.hget(keys.blocked("q"), "A") == "quota:userid:A"
        tenants = b.pl.inspect()["q"]["tenants"]
        assert tenants == {"ready": 0, "held_back": 1}
        assert b.pl.inspect()["other"]["tenants"] is None  # not indexed
        assert tick(b, 20) == []  # held back: nothing more of A, and not looked at
        b.client.delete(keys.wake("p"))
        token = {d.id: d.token for d in moved}
        # one of A's attempts ends (its terminal result): A is ready again, the pool's doorbell
        # rings and the key is published for attempts parked on it
        assert b.pl.cancel(a[0])
        assert sent(b, "A") == set(a[1:3])
        assert not b.client.hexists(keys.blocked("q"), "A")
        assert b.client.llen(keys.wake("p")) == 1
        msgs: list[str] = []

        def published() -> bool:
            m = pubsub.get_message(timeout=0.1)
            if m:
                msgs.extend(m["data"].split("\n"))  # "<queue>\n<key>..."
            return "quota:userid:A" in msgs

        wait_until(published, 5, "the key published on the freed channel")
        # 2 dispatched still: held back again at once, and its look-ahead topped up to 3
        assert [d.id for d in tick(b, 20)] == [a[3]]
        # a retry (requeue) is a leave too: its request goes back with its key
        assert b.store.requeue(a[1], token[a[1]], delay=0, attempted=True)
        assert [d.id for d in tick(b, 20)] == [a[1]]
        pubsub.close()


def test_a_held_tenant_wakes_once_its_key_is_down_to_limit_plus_half_its_lookahead(
    redis_url: str,
) -> None:
    """limit 2, look-ahead 4: A's 2 + 4 past the limit go out; one leave (5 left) keeps A held
    back (a tick sends nothing), the second (4 = 2 + 4 // 2 left) wakes it, and one tick tops
    the look-ahead up with two at once."""
    with bench(redis_url, QUEUES) as b:
        b.index("q", False)
        a = submit(b, "A", 12, "a")
        assert [d.id for d in tick(b, 20, la=4)] == a[:6]
        keys = b.store.keys
        assert b.client.hget(keys.blocked("q"), "A") == "quota:userid:A"
        assert b.pl.cancel(a[0])
        assert sent(b, "A") == set(a[1:6])
        assert b.client.hexists(keys.blocked("q"), "A")  # still over its limit: held
        assert tick(b, 20, la=4) == []
        assert b.pl.cancel(a[1])
        assert not b.client.hexists(keys.blocked("q"), "A")  # woken
        assert [d.id for d in tick(b, 20, la=4)] == a[6:8]
        assert b.client.hget(keys.blocked("q"), "A") == "quota:userid:A"
        for rid in a:
            b.pl.cancel(rid)
        assert sent(b, "A") == set()


def test_behind_a_full_slot_gate_no_tenant_is_sent_past_its_key(redis_url: str) -> None:
    """A composite of quota 2 (look-ahead 1) and a slot gate of 4 (look-ahead 2: the queue's
    cap 6, ``ahead_cap`` 4). A alone leaves the slot gate room: A's 2 and one past its key.
    With B too the slot gate is full (2 + 2): nobody is sent past a key, so C, coming later,
    still finds the queue's look-ahead room for its own 2 (before, A's and B's look-ahead took
    it and C waited for a finish)."""
    with bench(redis_url, QUEUES) as b:
        b.index("q", False)
        gate = {"specs": (quota_spec(2, 1),), "cap": 6, "ahead_cap": 4}

        def go() -> list[str]:
            moved = b.tick({"q": gate}, 20, LA).moved
            check_consistent(b, "q")
            return [d.id for d in moved]

        a = submit(b, "A", 5, "a")
        assert go() == a[:3]
        for rid in a[:3]:
            assert b.pl.cancel(rid)
        bees = submit(b, "B", 5, "b", offset=100)
        assert go() == [a[3], a[4], bees[0], bees[1]]
        assert sent(b, "A") == set(a[3:5]) and sent(b, "B") == set(bees[:2])
        cees = submit(b, "C", 5, "c", offset=200)
        assert go() == cees[:2]  # the slot gate's look-ahead: C's quota slots, parked there
        assert go() == []  # the queue's cap
        for rid in a + bees + cees:
            b.pl.cancel(rid)
        assert sent(b, "A") == sent(b, "B") == sent(b, "C") == set()


def test_a_hand_over_finish_makes_its_tenant_ready_without_ringing(redis_url: str) -> None:
    """A finish that handed its slot over while its process still has attempts parked
    (``nowake``) makes its held tenant ready without ringing the pool's doorbell: the
    dispatcher is rung when the parked attempts run low, and its next tick sends the tenant.
    Before, every such finish rang, and a tenant mix whose quotas fill the queue's cap ran a
    tick per request. A plain finish rings as before."""
    with bench(redis_url, QUEUES) as b:
        b.index("q", False)
        a = submit(b, "A", 4, "a")
        moved = tick(b, 20, la=0)
        assert [d.id for d in moved] == a[:2]
        keys = b.store.keys
        token = {d.id: d.token for d in moved}

        def finish(rid: str, handed_over: bool) -> Any:
            call = b.store.finish_call(
                rid,
                token[rid],
                attempted=True,
                status_code=200,
                payload="{}",
                handed_over=handed_over,
                nowake=handed_over,
            )
            return b.store.finished(run_batch(b.client, [call])[0])

        b.client.delete(keys.wake("p"))
        assert finish(a[0], True)
        assert not b.client.hexists(keys.blocked("q"), "A")  # ready
        assert b.client.llen(keys.wake("p")) == 0
        moved = tick(b, 20, la=0)
        assert [d.id for d in moved] == [a[2]]
        token.update({d.id: d.token for d in moved})
        assert b.client.hget(keys.blocked("q"), "A") == "quota:userid:A"
        assert finish(a[1], False)
        assert not b.client.hexists(keys.blocked("q"), "A")
        assert b.client.llen(keys.wake("p")) == 1
        for rid in a:
            b.pl.cancel(rid)
        assert sent(b, "A") == set()


def test_a_reaped_attempt_leaves_its_key(redis_url: str) -> None:
    with bench(redis_url, QUEUES) as b:
        b.index("q", True)
        a = submit(b, "A", 4, "a")
        moved = tick(b, 10, limit=1, la=0)
        assert [d.id for d in moved] == [a[0]]
        keys = b.store.keys
        # its worker died: the lease lapses (moved into the past, not waited for)
        b.client.zadd(keys.active("q"), {a[0]: time.time() - 60})
        assert b.store.reap("q") == [(a[0], moved[0].token)]
        assert sent(b, "A") == set()
        assert b.client.hlen(keys.blocked("q")) == 0
        check_consistent(b, "q")
        assert [d.id for d in tick(b, 10, limit=1, la=0)] == [a[0]]  # its original key


def test_leases_held_outside_the_dispatcher_count(redis_url: str) -> None:
    """A key's live leases count against its limit even when the dispatcher did not send
    their holders (another queue sharing the key, a holder from before a restart)."""
    with bench(redis_url, QUEUES) as b:
        b.index("q", False)
        env = GateEnv(b.client, b.store.keys)
        params = {"mode": "concurrency", "limit": 1}
        gate = build_gate("redis-quota", params, name="elsewhere", env=env)
        ctx = AcquireContext("x", "t", "other", "w", 30.0, time.time() + 60, {"userid": "A"})
        assert gate.acquire(ctx).admitted
        a = submit(b, "A", 3, "a")
        assert tick(b, 10, limit=1, la=0) == []  # held back at once
        assert b.client.hexists(b.store.keys.blocked("q"), "A")
        gate.release(ctx.holder)
        # no request of the dispatcher's left to wake A: the reaper's recheck does
        assert sched.recheck(b.store.scripts, b.store.keys, "q") == 1
        check_consistent(b, "q")
        assert [d.id for d in tick(b, 10, limit=1, la=0)] == [a[0]]
        gate.close()


def test_requests_without_the_attribute_are_never_held_back(redis_url: str) -> None:
    with bench(redis_url, QUEUES) as b:
        b.index("q", False)
        ids = submit(b, None, 5, "n")
        assert [d.id for d in tick(b, 10, limit=1, la=0)] == ids
        assert not b.client.keys(b.store.keys.prefix + "gate:*")


def test_setup_indexes_waiting_requests_and_teardown_removes_the_index(redis_url: str) -> None:
    with bench(redis_url, QUEUES) as b:
        before = submit(b, "A", 3, "x") + submit(b, "B", 2, "y", offset=50)
        keys, c = b.store.keys, b.client
        assert not c.exists(keys.sched("q"))
        b.index("q", True)
        check_consistent(b, "q")
        assert [d.id for d in tick(b, 3)] == [before[0], before[3], before[1]]  # turns
        sched.teardown(c, keys, "q")
        assert not c.keys(keys.prefix + "q:q:t:*")
        assert not c.exists(keys.sched("q"), keys.ready("q"), keys.blocked("q"))
        # back to the pending order, nothing lost
        rest = [d.id for d in b.tick({"q": {}}, 10).moved]
        assert rest == [before[2], before[4]]


def test_a_writer_that_skipped_the_index_is_caught_up_by_the_tick(redis_url: str) -> None:
    """Requests put in pending without their sub-queue (a script that does not index) are
    indexed by the next dispatch tick, a chunk at a time, and then dispatched in turn."""
    with bench(redis_url, QUEUES) as b:
        ids = submit(b, "A", 3, "a")
        keys, c = b.store.keys, b.client
        c.hset(keys.sched("q"), mapping={"attr": "userid", "fair": "1", "pool": "p"})
        moved = [d.id for d in b.tick({"q": {}}, 10).moved]
        assert moved == ids
        check_consistent(b, "q")


def test_malformed_entries_of_an_indexed_queue_are_reported(redis_url: str) -> None:
    with bench(redis_url, QUEUES) as b:
        b.index("q", True)
        keys, c = b.store.keys, b.client
        good = submit(b, "A", 2, "g")
        c.zadd(keys.pending("q"), {"garbage": 1, "000000000000001|nosuchrecord": 2})
        # a corrupted record: its tenant's sub-queue must still move on
        c.hset(keys.request(good[0]), "deadline", "soon")
        moved = [d.id for d in b.tick({"q": {}}, 10).moved]
        assert moved == [good[1]]
        results = [json.loads(x) for x in c.lrange(keys.default_result_list("q"), 0, -1)]
        codes = sorted((r["id"], r.get("error_code")) for r in results)
        assert codes == sorted(
            [
                ("garbage", "INVALID_REQUEST"),
                ("nosuchrecord", "INVALID_REQUEST"),
                (good[0], "INVALID_REQUEST"),
            ]
        )
        check_consistent(b, "q")


def test_the_quota_gate_parks_a_refusal_on_its_key(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with bench(redis_url, QUEUES) as b:
        env = GateEnv(client, b.store.keys)
        gate = build_gate("redis-quota", {"mode": "concurrency", "limit": 1}, name="g", env=env)
        spec = gate.quota_specs()
        assert [(s.key_prefix, s.attribute, s.limit) for s in spec] == [
            ("quota:userid:", "userid", 1)
        ]
        one = AcquireContext("r1", "t", "q", "w", 30.0, time.time() + 60, {"userid": "A"})
        two = AcquireContext("r2", "t", "q", "w", 30.0, time.time() + 60, {"userid": "A"})
        assert wake_keys(gate, two.metadata) == ["quota:userid:A"]
        assert gate.acquire(one).admitted
        d = gate.acquire(two)
        assert not d.admitted and d.wake_on_release and d.wake_key == "quota:userid:A"
        gate.release(one.holder)
        rate = build_gate("redis-quota", {"limit": 1}, name="r", env=env)
        assert rate.quota_specs() == [] and wake_keys(rate, two.metadata) == []
        classifying = {"mode": "concurrency", "limit": 1, "gating_mode": "classifying"}
        assert build_gate("redis-quota", classifying, name="c", env=env).quota_specs() == []
        composite = build_gate(
            "composite",
            {
                "gates": [
                    {
                        "gate_type": "redis-quota",
                        "gate_params": {"mode": "concurrency", "limit": 3},
                    },
                    {"gate_type": "global-max-concurrency", "gate_params": {"limit": 16}},
                ]
            },  # fmt: skip
            name="cmp",
            env=env,
        )
        assert [s.limit for s in composite.quota_specs()] == [3]
        assert wake_keys(composite, one.metadata) == ["quota:userid:A"]
        for g in (gate, rate, composite):
            g.close()
    client.close()


def test_a_reload_indexes_a_queue_that_needs_it_and_stops_for_one_that_does_not(
    redis_url: str,
) -> None:
    """The dispatcher indexes its queues at start and again after a reload (``apply``):
    turning ``fair_share`` on indexes the requests already waiting, turning it off (with no
    quota in the gates) removes the index and dispatch follows the pending order again."""
    from dataclasses import replace

    from pipeline.dispatch.dispatcher import Dispatcher

    with bench(redis_url, QUEUES) as b:
        ids = submit(b, "A", 2, "a") + submit(b, "B", 2, "b", offset=100)
        settings = b.pl.settings
        d = Dispatcher(settings, ["p"], node="n1", slots=4, send=lambda moved: None)
        d.setup_queues()
        keys, c = b.store.keys, b.client
        assert not c.exists(keys.sched("q"))  # nothing needs it
        fair = replace(settings.queues["q"], fair_share=True)
        d.apply(replace(settings, queues={**settings.queues, "q": fair}))
        check_consistent(b, "q")
        assert [m.id for m in d.store.tick(fair, [fair], 1.0, -1, 2).moved] == [ids[0], ids[2]]
        d.apply(settings)
        assert not c.exists(keys.sched("q"), keys.ready("q"))
        assert not c.keys(keys.prefix + "q:q:t:*")
        assert [m.id for m in d.store.tick(fair, [fair], 1.0, -1, 4).moved] == [ids[1], ids[3]]
        for gate in d.gates.values():
            gate.close()


def test_a_reload_that_adds_an_ingest_queue_polls_it(redis_url: str) -> None:
    """A queue a reload turns into an ingest queue is looked at every INGEST_POLL_S (a
    reference producer rings no doorbell): the dispatcher stops fusing its doorbell wait with
    the tick, and fuses it again when no queue ingests."""
    from dataclasses import replace

    from pipeline.dispatch.dispatcher import Dispatcher

    with bench(redis_url, QUEUES) as b:
        settings = b.pl.settings
        d = Dispatcher(settings, ["p"], node="n1", slots=4, send=lambda moved: None)
        try:
            assert not d.ingesting
            fused = d.fused()
            ingest = replace(settings.queues["q"], ingest="llm-d-async")
            d.apply(replace(settings, queues={**settings.queues, "q": ingest}))
            assert d.ingesting and not d.fused()
            d.apply(settings)
            assert not d.ingesting and d.fused() == fused
        finally:
            for gate in [*d.gates.values(), *d.retired]:
                gate.close()
