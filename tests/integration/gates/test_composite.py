"""composite, wait-on-refuse and tier-priority-admission."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from pipeline.errors import ConfigError
from pipeline.gates import Gate, GateEnv, Verdict, dispatch_budget
from pipeline.gates.composite import CompositeGate

from .conftest import ctx, lapse, lease_expiry


def local(limit: int, **extra: Any) -> dict[str, Any]:
    return {"gate_type": "local-max-concurrency", "gate_params": {"limit": limit, **extra}}


def budget_gate(key: str) -> dict[str, Any]:
    return {"gate_type": "redis", "gate_params": {"budget_key": key}}


def quota(limit: int, **extra: Any) -> dict[str, Any]:
    params = {"mode": "concurrency", "limit": limit, **extra}
    return {"gate_type": "redis-quota", "gate_params": params}


@pytest.fixture
def budget_key(genv: GateEnv) -> str:
    return f"{genv.keys.prefix}budget"


# -- composite --------------------------------------------------------------------------------
def test_composite_budget_is_the_min_and_capacity_the_min_counting(
    genv: GateEnv, make: Callable[..., Gate], budget_key: str
) -> None:
    gate = make("composite", {"gates": [budget_gate(budget_key), local(4), local(2)]})
    genv.client.set(budget_key, "0.8")
    assert gate.capacity() == 2
    a = ctx()
    assert gate.acquire(a).admitted
    assert gate.budget() == pytest.approx(0.5)  # the limit-2 gate is half full
    genv.client.set(budget_key, "0.3")
    assert gate.budget() == pytest.approx(0.3)
    # dispatch: the slot gates count themselves (1.0), so the metric gate's budget decides
    assert dispatch_budget(gate) == pytest.approx(0.3)
    assert gate.in_flight() == 1 and [h["request_id"] for h in gate.holders()] == [a.request_id]
    assert gate.release(a.holder) is True
    assert gate.release(a.holder) is False
    assert gate.in_flight() == 0


def test_composite_rolls_back_earlier_reservations_when_a_later_gate_refuses(
    genv: GateEnv, make: Callable[..., Gate], budget_key: str
) -> None:
    gate = make("composite", {"gates": json.dumps([local(5), budget_gate(budget_key)])})
    first = gate.gates[0]
    genv.client.set(budget_key, "0")
    d = gate.acquire(ctx())
    assert (d.verdict, d.reason) == (Verdict.REFUSE, "gate_closed")
    assert first.in_flight() == 0  # the local slot it took was given back
    genv.client.set(budget_key, "1")
    a = ctx()
    assert gate.acquire(a).admitted and first.in_flight() == 1
    gate.release(a.holder)
    assert first.in_flight() == 0


def test_composite_rolls_back_in_reverse_and_holds_at_the_tightest(
    make: Callable[..., Gate],
) -> None:
    gate = make("composite", {"gates": [local(3), quota(1), local(3)]})
    g0, g1, g2 = gate.gates
    a = ctx(metadata={"userid": "u"})
    assert gate.acquire(a).labels == {"classification": "reserved"}
    over = gate.acquire(ctx(metadata={"userid": "u"}))
    assert over.verdict is Verdict.REFUSE and over.labels == {"classification": "overflow"}
    assert (g0.in_flight(), g1.in_flight(), g2.in_flight()) == (1, 1, 1)
    assert gate.release(a.holder)
    assert (g0.in_flight(), g1.in_flight(), g2.in_flight()) == (0, 0, 0)


def test_composite_rolls_back_when_a_gate_raises(
    make: Callable[..., Gate],
) -> None:
    broken = {"gate_type": "redis-quota", "gate_params": {"limit": 1, "address": "127.0.0.1:1"}}
    gate = make("composite", {"gates": [local(2), broken]})
    with pytest.raises(Exception):  # noqa: B017 - any Redis error
        gate.acquire(ctx(metadata={"userid": "u"}))
    assert gate.gates[0].in_flight() == 0


def test_composite_renew_and_reap_fan_out(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("composite", {"gates": [local(2), quota(2)]})
    a = ctx(metadata={"userid": "u"})
    b = ctx(metadata={"userid": "u"})
    gate.acquire(a)
    gate.acquire(b)
    before = lease_expiry(genv, a.holder)
    gate.renew([a.holder], 100)
    assert lease_expiry(genv, a.holder) >= before + 60  # renewed in the inner gates
    lapse(genv, b.holder)  # in both inner gates
    assert gate.in_flight() == 1
    assert gate.reap() == [b.holder]  # reaped in both gates, reported once
    gate.release(a.holder)


# -- wait-on-refuse ---------------------------------------------------------------------------
def test_wait_on_refuse_turns_refuse_into_wait(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("wait-on-refuse", {"gate": local(1)})
    a = ctx()
    assert gate.acquire(a).admitted
    d = gate.acquire(ctx())
    assert (d.verdict, d.reason) == (Verdict.WAIT, "gate_closed")
    assert gate.capacity() == 1 and gate.per_node and gate.in_flight() == 1
    gate.release(a.holder)
    assert gate.acquire(ctx()).admitted is True
    lapse(genv, *(f"{h['request_id']}:{h['attempt']}" for h in gate.holders()))
    assert len(gate.reap()) == 1


def test_wait_on_refuse_keeps_reason_and_labels_and_passes_drop(
    make: Callable[..., Gate], genv: GateEnv, budget_key: str
) -> None:
    gate = make("wait-on-refuse", {"gate": json.dumps(quota(1))})
    a = ctx(metadata={"userid": "u"})
    gate.acquire(a)
    d = gate.acquire(ctx(metadata={"userid": "u"}))
    assert d.verdict is Verdict.WAIT and d.reason == "quota_exhausted"
    assert d.labels == {"classification": "overflow"}
    gate.release(a.holder)
    tier = {
        "gate_type": "tier-priority-admission",
        "gate_params": {
            "saturation_gate": "redis",
            "saturation_gate_params": {"budget_key": budget_key},
        },
    }
    dropping = make("wait-on-refuse", {"gate": tier}, name="q2")
    genv.client.set(budget_key, "0")
    d = dropping.acquire(ctx(labels={"classification": "overflow", "tier": "interactive"}))
    assert d.verdict is Verdict.DROP


# -- tier-priority-admission ------------------------------------------------------------------
TIER_TABLE = [
    # (classification, tier in labels, tier in metadata, expected verdict when saturated)
    ("reserved", "interactive", None, Verdict.WAIT),
    ("reserved", "batch", None, Verdict.WAIT),
    ("reserved", None, None, Verdict.WAIT),
    ("overflow", "interactive", None, Verdict.DROP),
    ("overflow", None, "interactive", Verdict.DROP),
    ("overflow", "async", None, Verdict.REFUSE),
    ("overflow", "batch", None, Verdict.REFUSE),
    ("overflow", None, None, Verdict.REFUSE),
    (None, "interactive", None, Verdict.REFUSE),
    (None, None, None, Verdict.REFUSE),
]


@pytest.mark.parametrize(("classification", "tier", "meta_tier", "expected"), TIER_TABLE)
def test_tier_table(
    genv: GateEnv,
    make: Callable[..., Gate],
    budget_key: str,
    classification: str | None,
    tier: str | None,
    meta_tier: str | None,
    expected: Verdict,
) -> None:
    gate = make(
        "tier-priority-admission",
        {
            "saturation_gate": "redis",
            "saturation_gate_params": json.dumps({"budget_key": budget_key}),
        },
    )
    labels = {k: v for k, v in (("classification", classification), ("tier", tier)) if v}
    metadata = {"tier": meta_tier} if meta_tier else {}
    c = ctx(labels=labels, metadata=metadata)
    assert gate.acquire(c).verdict is Verdict.CONTINUE  # not saturated: every row admitted
    genv.client.set(budget_key, "0")
    d = gate.acquire(c)
    assert d.verdict is expected
    if expected is Verdict.DROP:
        assert (d.reason, d.status_code) == ("dropped", 429)
        assert json.loads(d.payload or "") == {"error": "Too Many Requests", "code": 429}
    genv.client.set(budget_key, "0.5")
    assert gate.acquire(c).verdict is Verdict.CONTINUE  # resumes


def test_tier_custom_label_and_inner_reservation(make: Callable[..., Gate]) -> None:
    gate = make(
        "tier-priority-admission",
        {
            "saturation_gate": "local-max-concurrency",
            "saturation_gate_params": {"limit": 1},
            "tier_label": "lane",
        },
    )
    a = ctx()
    assert gate.acquire(a).admitted and gate.in_flight() == 1 and gate.capacity() == 1
    d = gate.acquire(ctx(labels={"classification": "overflow", "lane": "interactive"}))
    assert d.verdict is Verdict.DROP
    d = gate.acquire(ctx(labels={"classification": "overflow", "tier": "interactive"}))
    assert d.verdict is Verdict.REFUSE
    assert gate.release(a.holder)


def test_quota_then_tier_in_a_composite(
    genv: GateEnv, make: Callable[..., Gate], budget_key: str
) -> None:
    tier = {
        "gate_type": "tier-priority-admission",
        "gate_params": {
            "saturation_gate": "redis",
            "saturation_gate_params": {"budget_key": budget_key},
        },
    }
    gate = make("composite", {"gates": [quota(1, gating_mode="classifying"), tier]})
    q = gate.gates[0]
    genv.client.set(budget_key, "0")  # saturated
    reserved = gate.acquire(ctx(metadata={"userid": "u", "tier": "batch"}))
    assert reserved.verdict is Verdict.WAIT  # holds quota: park ...
    assert reserved.labels["classification"] == "reserved"
    assert q.in_flight() == 0  # ... without keeping the quota slot while parked
    held = ctx(metadata={"userid": "u"})
    genv.client.set(budget_key, "1")
    assert gate.acquire(held).admitted
    genv.client.set(budget_key, "0")
    over = gate.acquire(ctx(metadata={"userid": "u", "tier": "interactive"}))
    assert over.verdict is Verdict.DROP and over.status_code == 429
    over = gate.acquire(ctx(metadata={"userid": "u", "tier": "batch"}))
    assert over.verdict is Verdict.REFUSE
    assert gate.release(held.holder)


def test_composite_of_built_gates(genv: GateEnv, make: Callable[..., Gate]) -> None:
    queue_gate = make("redis-quota", {"mode": "concurrency", "limit": 1}, name="q")
    pool_gate = make("local-max-concurrency", {"limit": 2}, name="pool.p")
    chain = CompositeGate.of("q+pool.p", [queue_gate, pool_gate], genv)
    assert chain.capacity() == 2 and chain.per_node
    a = ctx(metadata={"userid": "u"})
    assert chain.acquire(a).admitted
    d = chain.acquire(ctx(metadata={"userid": "u"}))
    assert d.verdict is Verdict.REFUSE and pool_gate.in_flight() == 1  # nothing leaked
    assert chain.in_flight() == 1
    assert chain.release(a.holder)
    assert queue_gate.in_flight() == 0 and pool_gate.in_flight() == 0
    with pytest.raises(ConfigError):
        CompositeGate.of("empty", [], genv)
