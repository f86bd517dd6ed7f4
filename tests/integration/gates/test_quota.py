"""redis-quota: per-attribute concurrency leases and sliding-window rate limits."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.cli.services import wait_until
from pipeline.gates import Gate, GateEnv, Verdict

from .conftest import ctx, lapse, server_now

ALICE = {"userid": "alice"}
BOB = {"userid": "bob"}


def conc(**extra: Any) -> dict[str, Any]:
    return {"mode": "concurrency", "limit": 2, **extra}


def test_concurrency_limit_per_value_release_frees_and_is_idempotent(
    make: Callable[..., Gate],
) -> None:
    gate = make("redis-quota", conc())
    a, b, c = (ctx(metadata=ALICE) for _ in range(3))
    assert gate.acquire(a).labels == {"classification": "reserved"}
    assert gate.acquire(b).admitted
    over = gate.acquire(c)
    assert over.verdict is Verdict.REFUSE and over.reason == "quota_exhausted"
    assert over.labels == {"classification": "overflow"}
    bob = ctx(metadata=BOB)
    assert gate.acquire(bob).admitted  # another user has its own quota
    assert gate.in_flight() == 3
    assert gate.release(a.holder) is True
    assert gate.release(a.holder) is False
    assert gate.release("never:held") is False
    assert gate.acquire(c).admitted  # resumes when a slot frees
    for x in (b, c, bob):
        assert gate.release(x.holder)
    assert gate.in_flight() == 0
    assert gate.budget() == 1.0 and gate.capacity() is None


def test_missing_attribute_passes_untouched(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", conc(limit=1))
    for _ in range(3):
        d = gate.acquire(ctx(metadata={"other": "x"}))
        assert d.admitted and d.labels == {}
    assert gate.in_flight() == 0


def test_metadata_prefixed_attribute(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", conc(limit=1, attribute="metadata.tenant"))
    a = ctx(metadata={"tenant": "t1"})
    assert gate.acquire(a).admitted
    assert not gate.acquire(ctx(metadata={"tenant": "t1"})).admitted
    gate.release(a.holder)


def test_lease_expiry_then_reap_frees_and_returns_the_holder(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", conc(limit=1))
    a = ctx(metadata=ALICE)
    assert gate.acquire(a).admitted
    assert not gate.acquire(ctx(metadata=ALICE)).admitted
    lapse(genv, a.holder)  # a crashed and stopped renewing
    assert gate.in_flight() == 0
    assert gate.reap() == [a.holder]
    assert gate.reap() == []
    b = ctx(metadata=ALICE)
    assert gate.acquire(b).admitted
    gate.release(b.holder)


def test_renew_keeps_a_lease_alive_past_its_original_expiry(make: Callable[..., Gate]) -> None:
    """A 0.3 s lease renewed every 0.1 s outlives its first expiry by the server's clock."""
    gate = make("redis-quota", conc(limit=1))
    a = ctx(metadata=ALICE, lease_s=0.3)
    gate.acquire(a)
    first = gate.holders()[0]["lease_expires_at"]
    while server_now(gate.client) < first + 0.5:
        gate.renew([a.holder, "unknown:h"], 0.3)
        time.sleep(0.1)  # the heartbeat's period, not a wait for a condition
    assert gate.reap() == []
    assert gate.in_flight() == 1
    assert not gate.acquire(ctx(metadata=ALICE)).admitted
    (entry,) = gate.holders()
    assert entry["request_id"] == a.request_id and entry["lease_expires_at"] > first
    gate.release(a.holder)


def test_reap_of_one_gate_leaves_another_gates_holders(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    g1 = make("redis-quota", conc(limit=2), name="q1")
    g2 = make("redis-quota", conc(limit=2), name="q2")
    a = ctx(metadata=ALICE)
    b = ctx(metadata=ALICE)
    assert g1.acquire(a).admitted and g2.acquire(b).admitted
    # the two queues share alice's quota (same prefix): the third is over it
    assert not g1.acquire(ctx(metadata=ALICE)).admitted
    lapse(genv, a.holder, b.holder)
    assert g1.reap() == [a.holder]
    assert g2.reap() == [b.holder]


def test_concurrent_acquires_never_exceed_the_limit(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", conc(limit=3))
    contexts = [ctx(metadata=ALICE) for _ in range(40)]
    with ThreadPoolExecutor(16) as pool:
        won = [
            c for c, d in zip(contexts, pool.map(gate.acquire, contexts), strict=True) if d.admitted
        ]
    assert len(won) == 3 and gate.in_flight() == 3
    for c in won:
        gate.release(c.holder)


def test_classifying_concurrency_tags_and_never_blocks(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", conc(limit=1, gating_mode="classifying"))
    a, b = ctx(metadata=ALICE), ctx(metadata=ALICE)
    first, second = gate.acquire(a), gate.acquire(b)
    assert first.verdict is Verdict.CONTINUE and first.labels["classification"] == "reserved"
    assert second.verdict is Verdict.CONTINUE and second.labels["classification"] == "overflow"
    assert gate.in_flight() == 1  # overflow holds nothing
    assert gate.release(b.holder) is False
    assert gate.release(a.holder) is True


def test_rate_limit_sliding_window_not_refunded(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", {"limit": 2, "window": "500ms"})
    a, b = ctx(metadata=ALICE), ctx(metadata=ALICE)
    t0 = time.monotonic()
    assert gate.acquire(a).admitted and gate.acquire(b).admitted
    assert gate.release(a.holder) is False  # admissions are not refunded
    late = ctx(metadata=ALICE)
    refused = gate.acquire(late)
    assert refused.verdict is Verdict.REFUSE and refused.reason == "quota_exhausted"
    assert gate.acquire(ctx(metadata=BOB)).admitted  # per value
    if time.monotonic() - t0 < 0.4:  # still inside the window: still refused
        assert not gate.acquire(ctx(metadata=ALICE)).admitted
    wait_until(lambda: gate.acquire(late).admitted, 3, "gate.acquire(late).admitted")
    assert time.monotonic() - t0 >= 0.45
    assert gate.in_flight() == 0


def test_rate_limit_same_holder_counts_once(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", {"limit": 2, "window": 60})
    a = ctx(metadata=ALICE)
    assert gate.acquire(a).admitted and gate.acquire(a).admitted
    assert gate.acquire(ctx(metadata=ALICE)).admitted
    assert not gate.acquire(ctx(metadata=ALICE)).admitted


def test_rate_limit_admissions_in_the_same_instant_do_not_collide(
    make: Callable[..., Gate],
) -> None:
    gate = make("redis-quota", {"limit": 3, "window": 60})
    results = [gate.acquire(ctx(metadata=ALICE)).admitted for _ in range(5)]
    assert results == [True, True, True, False, False]


def test_two_windows_on_one_key_do_not_interfere(make: Callable[..., Gate]) -> None:
    short = make("redis-quota", {"limit": 1, "window": 0.3}, name="short")
    long = make("redis-quota", {"limit": 2, "window": 60}, name="long")
    assert long.acquire(ctx(metadata=ALICE)).admitted
    assert short.acquire(ctx(metadata=ALICE)).admitted
    wait_until(
        lambda: short.acquire(ctx(metadata=ALICE)).admitted,
        3,
        "short.acquire(ctx(metadata=ALICE)).admitted",
    )
    # the short window's purges never dropped the long window's entry: one slot left there
    assert long.acquire(ctx(metadata=ALICE)).admitted
    assert not long.acquire(ctx(metadata=ALICE)).admitted


def test_rate_limit_log_expires(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", {"limit": 1, "window": 0.2})
    gate.acquire(ctx(metadata=ALICE))
    key = gate.rate_key("alice")
    assert genv.client.exists(key)
    assert 0 < genv.client.pttl(key) <= 1200


def test_classifying_rate_limit_never_blocks(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", {"limit": 1, "window": 60, "gating_mode": "classifying"})
    got = [gate.acquire(ctx(metadata=ALICE)) for _ in range(3)]
    assert all(d.verdict is Verdict.CONTINUE for d in got)
    assert [d.labels["classification"] for d in got] == ["reserved", "overflow", "overflow"]
