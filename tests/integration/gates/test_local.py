"""local-max-concurrency: a per-node limit held in Redis across processes."""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.cli.services import wait_until
from pipeline.gates import Gate, GateEnv, HandsOver, Verdict, build_gate, dispatch_budget

from .conftest import LEASE_S, REDIS_URL, ctx, lapse, lease_expiry, server_now


def test_admits_below_limit_refuses_at_it_and_resumes_after_release(
    make: Callable[..., Gate],
) -> None:
    gate = make("local-max-concurrency", {"limit": 2})
    a, b, c = ctx(), ctx(), ctx()
    assert gate.budget() == 1.0
    assert gate.acquire(a).admitted
    assert gate.budget() == 0.5
    assert gate.acquire(b).admitted
    full = gate.acquire(c)
    assert (full.verdict, full.reason) == (Verdict.REFUSE, "gate_closed")
    assert full.wake_on_release  # a release ends it: the attempt may park for one
    assert gate.in_flight() == 2 and gate.budget() == 0.0
    assert dispatch_budget(gate) == 1.0  # the dispatcher counts the slots itself
    assert gate.release(a.holder) is True
    assert gate.release(a.holder) is False  # idempotent
    assert gate.acquire(c).admitted
    assert {h["request_id"] for h in gate.holders()} == {b.request_id, c.request_id}
    for x in (b, c):
        gate.release(x.holder)
    assert gate.in_flight() == 0 and gate.budget() == 1.0


def test_blocking_mode_waits_when_full(make: Callable[..., Gate]) -> None:
    gate = make("local-max-concurrency", {"limit": 1, "gating_mode": "blocking"})
    a = ctx()
    assert gate.acquire(a).admitted
    assert gate.acquire(ctx()).verdict is Verdict.WAIT
    gate.release(a.holder)


def test_reacquire_by_the_same_holder_takes_no_second_slot(make: Callable[..., Gate]) -> None:
    gate = make("local-max-concurrency", {"limit": 2})
    a = ctx()
    assert gate.acquire(a).admitted and gate.acquire(a).admitted
    assert gate.in_flight() == 1
    gate.release(a.holder)


def test_unknown_holder_release_is_a_noop(make: Callable[..., Gate]) -> None:
    gate = make("local-max-concurrency", {"limit": 1})
    assert gate.release("nobody:x") is False
    assert gate.in_flight() == 0


def test_holders_describe_request_attempt_worker_age_and_lease(
    make: Callable[..., Gate],
) -> None:
    gate = make("local-max-concurrency", {"limit": 3})
    a = ctx("req-1", "tok9", worker="celery@h1")
    gate.acquire(a)
    (entry,) = gate.holders()
    assert entry["request_id"] == "req-1" and entry["attempt"] == "tok9"
    assert entry["worker"] == "celery@h1"
    assert 0 <= entry["age_s"] < 5
    assert entry["lease_expires_at"] == pytest.approx(server_now(gate.env.client) + LEASE_S, abs=5)
    assert gate.describe()["in_flight"] == 1
    gate.release(a.holder)


def test_a_lease_ends_on_a_whole_second_of_the_servers_clock(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """Acquire and renew round the lease's end up to a whole second (an integer score: Redis
    compares it without parsing text), never before now + the lease, at most 1 s after it."""
    gate = make("local-max-concurrency", {"limit": 1})
    a = ctx(lease_s=10)
    before = server_now(genv.client)
    assert gate.acquire(a).admitted
    expiry = lease_expiry(genv, a.holder)
    assert expiry == int(expiry) and before + 10 <= expiry <= server_now(genv.client) + 11
    before = server_now(genv.client)
    gate.renew([a.holder], 20)
    expiry = lease_expiry(genv, a.holder)
    assert expiry == int(expiry) and before + 20 <= expiry <= server_now(genv.client) + 21
    gate.release(a.holder)


def test_expired_lease_stops_counting_and_reap_frees_it(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("local-max-concurrency", {"limit": 1})
    a = ctx()
    assert gate.acquire(a).admitted
    assert not gate.acquire(ctx()).admitted
    lapse(genv, a.holder)  # the holder crashed: a lease period without renewal
    assert gate.in_flight() == 0
    assert gate.reap() == [a.holder]
    assert gate.reap() == []
    assert gate.release(a.holder) is False


def test_a_lease_runs_out_by_the_servers_clock(make: Callable[..., Gate]) -> None:
    """No caller's clock is involved: a 0.2 s lease stops counting 0.2 s later."""
    gate = make("local-max-concurrency", {"limit": 1})
    a = ctx(lease_s=0.2)
    assert gate.acquire(a).admitted
    wait_until(lambda: gate.in_flight() == 0, 5, "gate.in_flight() == 0")
    assert gate.reap() == [a.holder]


def test_renew_keeps_a_lease_alive_but_never_revives_an_expired_one(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("local-max-concurrency", {"limit": 2})
    a, b = ctx(lease_s=10), ctx(lease_s=10)
    gate.acquire(a)
    gate.acquire(b)
    before = lease_expiry(genv, a.holder)
    gate.renew([a.holder], 100)  # a's heartbeat moves its expiry later
    assert lease_expiry(genv, a.holder) >= before + 89
    lapse(genv, b.holder)  # b was silent for a lease period
    assert [h["request_id"] for h in gate.holders()] == [a.request_id]
    gate.renew([a.holder, b.holder], 100)  # b's late heartbeat must not revive it
    assert gate.in_flight() == 1
    assert gate.reap() == [b.holder]
    gate.release(a.holder)


def test_limit_is_per_node(genv: GateEnv) -> None:
    other = GateEnv(genv.client, genv.keys, node="node-b")
    g1 = build_gate("local-max-concurrency", {"limit": 1}, name="q", env=genv)
    g2 = build_gate("local-max-concurrency", {"limit": 1}, name="q", env=other)
    a, b = ctx(), ctx()
    assert g1.acquire(a).admitted and g2.acquire(b).admitted
    assert not g1.acquire(ctx()).admitted
    # each node admits up to its own limit; the counts seen from anywhere cover all nodes
    assert g1.budget() == 0.0 and g2.budget() == 0.0
    assert g1.in_flight() == 2 and g2.in_flight() == 2
    assert {h["request_id"] for h in g1.holders()} == {a.request_id, b.request_id}
    # a reaper on node a can free a (dead) node b's holder
    assert g1.release(b.holder) is True and g2.release(b.holder) is False
    assert g2.budget() == 1.0 and g1.in_flight() == 1
    g1.release(a.holder)


def test_reap_frees_a_dead_nodes_expired_leases(genv: GateEnv) -> None:
    dead = GateEnv(genv.client, genv.keys, node="node-dead")
    g_dead = build_gate("local-max-concurrency", {"limit": 2}, name="q", env=dead)
    g_live = build_gate("local-max-concurrency", {"limit": 2}, name="q", env=genv)
    c = ctx()
    assert g_dead.acquire(c).admitted
    assert g_live.reap() == []  # alive: nothing to free
    lapse(genv, c.holder)
    assert g_live.reap() == [c.holder]
    assert g_live.in_flight() == 0


def test_budget_fails_closed_when_redis_is_unreachable(genv: GateEnv) -> None:
    dead = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    gate = build_gate(
        "local-max-concurrency", {"limit": 1}, name="q", env=GateEnv(dead, genv.keys, "n")
    )
    assert gate.budget() == 0.0


def test_concurrent_threads_never_exceed_the_limit(make: Callable[..., Gate]) -> None:
    gate = make("local-max-concurrency", {"limit": 3})
    contexts = [ctx() for _ in range(40)]
    with ThreadPoolExecutor(16) as pool:
        admitted = [
            c for c, d in zip(contexts, pool.map(gate.acquire, contexts), strict=True) if d.admitted
        ]
    assert len(admitted) == 3 and gate.in_flight() == 3
    for c in admitted:
        gate.release(c.holder)


def _child(prefix: str, n: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    from pipeline.store.keys import Keys

    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    genv = GateEnv(client, Keys(prefix), node="node-a")
    gate = build_gate("local-max-concurrency", {"limit": 2}, name="q", env=genv)
    contexts = [ctx(f"p{os.getpid()}-{i}") for i in range(n)]
    won = [c.holder for c in contexts if gate.acquire(c).admitted]
    out.put(won)


def test_limit_holds_across_processes_of_one_node(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("local-max-concurrency", {"limit": 2})
    mp = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = mp.Queue()  # type: ignore[type-arg]
    procs = [mp.Process(target=_child, args=(genv.keys.prefix, 5, out)) for _ in range(3)]
    for p in procs:
        p.start()
    won = [h for _ in procs for h in out.get(timeout=20)]
    for p in procs:
        p.join(10)
    assert len(won) == 2 and gate.in_flight() == 2
    for h in won:
        assert gate.release(h)


@pytest.mark.parametrize("kind", ["local-max-concurrency", "global-max-concurrency"])
def test_transfer_hands_a_slot_over_in_one_step(make: Callable[..., Gate], kind: str) -> None:
    gate = make(kind, {"limit": 2})
    assert isinstance(gate, HandsOver)
    a, b, c = ctx("giver"), ctx("other"), ctx("taker", worker="celery@h2")
    assert gate.acquire(a).admitted and gate.acquire(b).admitted
    # the pool was full: the slot went a -> c
    assert gate.transfer_calls(a.holder, c, "q").run() is True
    assert gate.in_flight() == 2
    entry = next(h for h in gate.holders() if h["request_id"] == "taker")
    assert entry["handed_over_by"] == "giver" and entry["worker"] == "celery@h2"
    assert entry["lease_expires_at"] == pytest.approx(server_now(gate.env.client) + LEASE_S, abs=5)
    assert {h["handed_over_by"] for h in gate.holders() if h["request_id"] == "other"} == {None}
    assert gate.release(a.holder) is False  # the giver holds nothing any more
    for x in (b, c):
        assert gate.release(x.holder) is True
    assert gate.in_flight() == 0


def test_transfer_from_a_holder_whose_lease_was_reaped_takes_a_free_slot_or_none(
    make: Callable[..., Gate],
) -> None:
    gate = make("local-max-concurrency", {"limit": 1})
    gone, taker, other = ctx("gone"), ctx("taker"), ctx("other")
    assert isinstance(gate, HandsOver)
    assert gate.transfer_calls(gone.holder, taker, "q").run() is True  # room: like an acquire
    assert gate.transfer_calls(gone.holder, other, "q").run() is False  # full; "gone" held none
    assert [h["request_id"] for h in gate.holders()] == ["taker"]
    gate.release(taker.holder)


def test_gates_that_count_other_things_do_not_hand_over(make: Callable[..., Gate]) -> None:
    rate = make("redis-quota", {"limit": 2})  # admissions in a window are not slots
    classifying = make(
        "redis-quota", {"limit": 2, "mode": "concurrency", "gating_mode": "classifying"}
    )
    assert not isinstance(rate, HandsOver)
    assert isinstance(classifying, HandsOver)  # a concurrency quota, but it never refuses:
    assert classifying.handover_bells("q", {"userid": "u"}) == ()  # nobody parks for a slot


def test_a_quota_hands_a_slot_over_to_an_attempt_of_the_same_key(
    make: Callable[..., Gate],
) -> None:
    """A blocking concurrency quota's slot is one of its key's: a holder hands it to an
    attempt parked on that key's bell, without the slot ever being free."""
    quota = make("redis-quota", {"limit": 1, "mode": "concurrency"})
    user = {"userid": "u"}
    giver, taker = ctx(metadata=user), ctx(metadata=user)
    assert isinstance(quota, HandsOver)
    assert quota.handover_bells("q", taker.metadata) == ("quota:userid:u",)
    assert quota.acquire(giver).admitted and not quota.acquire(taker).admitted
    assert quota.transfer_calls(giver.holder, taker, "quota:userid:u").run()
    (held,) = quota.holders()
    assert held["request_id"] == taker.request_id
    assert held["handed_over_by"] == giver.request_id
    assert not quota.acquire(ctx(metadata=user)).admitted  # still one slot, taken
    assert quota.release(taker.holder) and quota.in_flight() == 0


def test_a_dead_nodes_entry_is_forgotten_once_its_slot_pool_is_gone(genv: GateEnv) -> None:
    """The per-node registry lists a node while its slot pool exists: a fleet that restarts
    under new node names for months does not grow it."""
    dead = GateEnv(genv.client, genv.keys, node="node-dead")
    g_dead = build_gate("local-max-concurrency", {"limit": 2}, name="q", env=dead)
    g_live = build_gate("local-max-concurrency", {"limit": 2}, name="q", env=genv)
    registry = genv.keys.gate_nodes("q")
    c = ctx()
    assert g_dead.acquire(c).admitted
    assert genv.client.smembers(registry) == {"node-dead"}
    assert g_live.reap() == [] and genv.client.smembers(registry) == {"node-dead"}
    lapse(genv, c.holder)
    assert g_live.reap() == [c.holder]  # its last lease freed: its pool is gone, and so is it
    assert genv.client.smembers(registry) == set()
    d = ctx()
    assert g_dead.acquire(d).admitted  # taking a slot lists it again, in the same step
    assert genv.client.smembers(registry) == {"node-dead"}
    assert g_live.in_flight() == 1
    g_dead.release(d.holder)


def tenant_composite(make: Callable[..., Gate]) -> Gate:
    """A concurrency quota of 1 per user behind a global limit of 2."""
    quota = {"gate_type": "redis-quota", "gate_params": {"limit": 1, "mode": "concurrency"}}
    slot = {"gate_type": "global-max-concurrency", "gate_params": {"limit": 2}}
    return make("composite", {"gates": [quota, slot]})


def test_a_composite_hands_its_tenants_slots_to_an_attempt_parked_on_the_key(
    make: Callable[..., Gate],
) -> None:
    """Behind one per-key quota and a slot gate, a holder hands the key's slot and the slot
    gate's to an attempt of its tenant that the key refused (parked on the key): nothing is
    freed for an attempt just started to take first, and the taker's release frees both. An
    attempt parked for the slot gate (holding its own quota slot) takes the slot gate's only."""
    gate = tenant_composite(make)
    assert isinstance(gate, HandsOver)
    quota, slot = gate.parts()
    user, other = {"userid": "u"}, {"userid": "v"}
    assert gate.handover_bells("q", user) == ("q", "quota:userid:u")
    assert gate.handover_bells("q", {}) == ("q",)  # no tenant: the slot gate's only
    giver, taker = ctx("giver", metadata=user), ctx("taker", metadata=user)
    assert gate.acquire(giver).admitted
    refused = gate.acquire(taker)
    assert not refused.admitted and refused.bell("q") == "quota:userid:u"
    assert gate.transfer_calls(giver.holder, taker, "quota:userid:u").run() is True
    for part in (quota, slot):
        (held,) = part.holders()
        assert held["request_id"] == "taker" and held["handed_over_by"] == "giver"
    assert not gate.acquire(ctx(metadata=user)).admitted  # the key's one slot is still taken
    # the slot gate's own line: the taker of another tenant keeps its quota slot, gets the slot
    third = ctx("third", metadata=other)
    assert gate.acquire(third).admitted  # the slot gate is full now (2)
    fourth = ctx("fourth", metadata={"userid": "w"})
    assert not gate.acquire(fourth).admitted  # refused by the slot gate, keeping its quota slot
    assert gate.transfer_calls(taker.holder, fourth, "q").run() is True
    assert sorted(h["request_id"] for h in quota.holders()) == ["fourth", "third"]
    assert sorted(h["request_id"] for h in slot.holders()) == ["fourth", "third"]
    for x in (third, fourth):
        assert gate.release(x.holder)
    assert quota.in_flight() == 0 and slot.in_flight() == 0


def test_a_composite_hand_over_on_the_key_half_taken_is_held_and_logged(
    make: Callable[..., Gate], caplog: pytest.LogCaptureFixture
) -> None:
    """The giver's key slot lapsed and went to another attempt of its tenant: the hand-over
    on the key takes the slot gate's slot only. The taker holds it (its release frees it;
    the key's release is a no-op) and the half not taken is logged."""
    gate = tenant_composite(make)
    assert isinstance(gate, HandsOver)
    quota, slot = gate.parts()
    user = {"userid": "u"}
    giver, taker, other = (ctx(name, metadata=user) for name in ("giver", "taker", "other"))
    assert gate.acquire(giver).admitted
    assert quota.release(giver.holder)  # as if its lease on the key lapsed and was reaped
    assert quota.acquire(other).admitted  # and another attempt of the tenant took the key
    with caplog.at_level(logging.WARNING, logger="pipeline.gates.composite"):
        assert gate.transfer_calls(giver.holder, taker, "quota:userid:u").run() is True
    assert "the key's was not taken" in caplog.text
    assert [h["request_id"] for h in quota.holders()] == ["other"]
    assert [h["request_id"] for h in slot.holders()] == ["taker"]
    assert gate.release(taker.holder) and quota.release(other.holder)
    assert quota.in_flight() == 0 and slot.in_flight() == 0
