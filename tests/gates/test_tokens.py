"""redis-quota in tokens mode: a sliding window of token charges per key, on the real Redis.
One test per rule: charge the estimate, refuse with the time until the window frees enough,
settle to the usage, refund, drop what can never fit, classify, compose."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.errors import ConfigError
from pipeline.gates import AcquireContext, Gate, GateEnv, Settles, Verdict, build_gate, settle
from pipeline.gates.base import walk
from pipeline.gates.quota import SETTLE_POLL_S

from .conftest import ctx, server_now

ALICE = {"userid": "alice"}
BOB = {"userid": "bob"}


def tokens(limit: int = 100, window: Any = 60, **extra: Any) -> dict[str, Any]:
    return {"mode": "tokens", "limit": limit, "window": window, **extra}


def req(
    max_tokens: int, prompt: str = "", metadata: dict[str, str] | None = None
) -> AcquireContext:
    """A request whose estimate is ceil(len(prompt) / 4) + max_tokens."""
    c = ctx(metadata=metadata if metadata is not None else ALICE)
    payload = json.dumps({"prompt": prompt, "max_tokens": max_tokens})
    return AcquireContext(**{**c.__dict__, "payload": payload})


def charges(genv: GateEnv, gate: Gate, value: str = "alice") -> dict[str, str]:
    _, hash_key = gate.tokens_keys(value)  # type: ignore[attr-defined]
    return dict(genv.client.hgetall(hash_key))


def test_admission_charges_the_estimate_until_the_limit(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(100))
    a, b, c = req(40, "x" * 8), req(50), req(10)  # 42, 50, 10
    assert gate.acquire(a).labels == {"classification": "reserved"}
    assert gate.acquire(b).admitted
    assert charges(genv, gate) == {a.holder: "e42", b.holder: "e50"}
    over = gate.acquire(c)  # 92 + 10 > 100
    assert over.verdict is Verdict.REFUSE and over.reason == "quota_exhausted"
    assert over.labels == {"classification": "overflow"}
    assert gate.acquire(req(8)).admitted  # 92 + 8 fits exactly
    assert gate.acquire(req(1, metadata=BOB)).admitted  # another key has its own budget
    assert gate.in_flight() == 0  # nothing is held: a charge is not a reservation


def test_the_same_holder_is_charged_once(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100))
    a = req(60)
    assert gate.acquire(a).admitted and gate.acquire(a).admitted
    assert charges(genv, gate) == {a.holder: "e60"}
    assert not gate.acquire(req(60)).admitted


def stamps(genv: GateEnv, gate: Gate, *holders: str) -> list[float]:
    log_key, _ = gate.tokens_keys("alice")  # type: ignore[attr-defined]
    return [float(genv.client.zscore(log_key, h)) for h in holders]


def test_a_refusal_waits_until_enough_of_the_window_has_expired(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """Charges settled at t0 (30) and t1 (50), limit 100, window 60 s: a request of 40 needs
    the first to expire, so its delay is t0 + 60 - now; one of 75 needs both: t1 + 60 - now."""
    gate = make("redis-quota", tokens(100))
    a, b = req(30), req(50)
    gate.acquire(a)
    gate.acquire(b)
    gate.settle(a, 30)  # settled: no settlement can make room sooner
    gate.settle(b, 50)
    t0, t1 = stamps(genv, gate, a.holder, b.holder)
    before = server_now(genv.client)
    small = gate.acquire(req(40))
    large = gate.acquire(req(75))
    after = server_now(genv.client)
    assert small.retry_after is not None and large.retry_after is not None
    assert t0 + 60 - after - 0.002 <= small.retry_after <= t0 + 60 - before + 0.002
    assert t1 + 60 - after - 0.002 <= large.retry_after <= t1 + 60 - before + 0.002


def test_a_refusal_asks_again_soon_when_charges_in_flight_could_settle_lower(
    make: Callable[..., Gate],
) -> None:
    gate = make("redis-quota", tokens(100))
    gate.acquire(req(90))  # an estimate, in flight
    refused = gate.acquire(req(20))
    assert refused.retry_after is not None and refused.retry_after <= SETTLE_POLL_S
    full = make("redis-quota", tokens(100), name="other")
    settled = req(90, metadata=BOB)
    full.acquire(settled)
    full.settle(settled, 90)
    refused = full.acquire(req(20, metadata=BOB))  # nothing left to settle: the window
    assert refused.retry_after is not None and refused.retry_after > 50


def test_the_window_expires_and_admits_again(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100, window="400ms"))
    first = req(100)
    assert gate.acquire(first).admitted
    gate.settle(first, 100)
    late = req(100)
    refused = gate.acquire(late)
    assert refused.retry_after is not None and 0 < refused.retry_after <= 0.4
    wait_until(lambda: gate.acquire(late).admitted, 3, "gate.acquire(late).admitted")


def test_settling_lower_makes_room_and_higher_takes_it(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(100))
    a = req(80)
    assert gate.acquire(a).admitted
    assert not gate.acquire(req(30)).admitted
    gate.settle(a, 20)  # the response said 20 tokens were used
    assert charges(genv, gate) == {a.holder: "20"}
    b = req(80)
    assert gate.acquire(b).admitted  # 20 + 80
    gate.settle(b, 95)  # used more than estimated: the window now holds 115
    assert not gate.acquire(req(1)).admitted


def test_a_settled_charge_counts_for_a_window_from_its_settlement(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """Re-stamped when settled: the tokens the server received before the answer all lie in
    the windows the charge is counted in, however late the request reached the server."""
    gate = make("redis-quota", tokens(100))
    a = req(50)
    gate.acquire(a)
    (admitted,) = stamps(genv, gate, a.holder)
    before = server_now(genv.client)
    gate.settle(a, 40)
    (settled,) = stamps(genv, gate, a.holder)
    assert settled >= before > admitted
    for key in gate.tokens_keys("alice"):  # type: ignore[attr-defined]
        assert genv.client.pttl(key) > 60_000


def test_settling_to_none_keeps_the_estimate_as_settled(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """An answer that never came (a time-out): the estimate stays charged, no longer open."""
    gate = make("redis-quota", tokens(100))
    a = req(70)
    gate.acquire(a)
    gate.settle(a, None)
    assert charges(genv, gate) == {a.holder: "70"}
    refused = gate.acquire(req(40))
    assert refused.retry_after is not None and refused.retry_after > 50  # nothing left open


def test_settle_is_idempotent_and_a_refund_removes_the_charge(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(100))
    a = req(100)
    assert gate.acquire(a).admitted
    gate.settle(a, 0)
    gate.settle(a, 0)
    assert charges(genv, gate) == {}
    gate.settle(a, 40)  # no charge any more: nothing to settle
    assert charges(genv, gate) == {}
    assert gate.acquire(req(100)).admitted
    gate.settle(req(5), 50)  # never charged: a no-op
    assert len(charges(genv, gate)) == 1


def test_an_estimate_above_the_whole_budget_is_dropped_saying_so(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(100, window="1m"))
    dropped = gate.acquire(req(99, "x" * 8))  # 2 + 99
    assert dropped.verdict is Verdict.DROP
    assert "101" in dropped.message and "100 tokens per 60 s" in dropped.message
    assert charges(genv, gate) == {}
    assert gate.acquire(req(100)).admitted  # the whole budget is not too big


def test_classifying_tokens_never_blocks(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100, gating_mode="classifying"))
    got = [gate.acquire(r) for r in (req(60), req(60), req(500))]
    assert all(d.verdict is Verdict.CONTINUE for d in got)
    assert [d.labels["classification"] for d in got] == ["reserved", "overflow", "overflow"]
    assert len(charges(genv, gate)) == 1  # overflow is not charged


def test_without_the_attribute_it_passes_uncharged(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(10))
    for _ in range(3):
        d = gate.acquire(req(10_000, metadata={}))
        assert d.admitted and d.labels == {}


def test_default_max_tokens_is_the_budget_of_a_body_without_max_tokens(
    make: Callable[..., Gate],
) -> None:
    gate = make("redis-quota", tokens(100, default_max_tokens=60))
    c = ctx(metadata=ALICE)
    no_max = AcquireContext(**{**c.__dict__, "payload": '{"prompt": "abcd"}'})
    assert gate.estimate(no_max) == 61  # type: ignore[attr-defined]
    assert gate.acquire(no_max).admitted
    assert not gate.acquire(req(40)).admitted


def test_release_renew_and_reap_hold_nothing(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100))
    a = req(50)
    assert gate.acquire(a).admitted
    assert gate.release(a.holder) is False
    gate.renew([a.holder], 30)
    assert gate.reap() == [] and gate.holders() == []
    assert not gate.acquire(req(60)).admitted  # the charge stays until settled or expired


def test_the_keys_expire_after_the_window(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100, window=2))
    gate.acquire(req(5))
    for key in gate.tokens_keys("alice"):  # type: ignore[attr-defined]
        assert 0 < genv.client.pttl(key) <= 3000


def test_concurrent_admissions_never_charge_past_the_limit(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(1000))
    sizes = [37, 91, 13, 120, 55, 8, 77, 64] * 5
    reqs = [req(n) for n in sizes]
    with ThreadPoolExecutor(8) as pool:
        admitted = list(pool.map(lambda r: gate.acquire(r).admitted, reqs))
    charged = sum(int(v[1:]) for v in charges(genv, gate).values())
    assert charged == sum(n for n, ok in zip(sizes, admitted, strict=True) if ok)
    assert charged <= 1000
    assert not all(admitted)  # the budget was the limit, not the requests


def test_a_composite_rollback_refunds_the_charge(genv: GateEnv, make: Callable[..., Gate]) -> None:
    params = {
        "gates": [
            {"gate_type": "redis-quota", "gate_params": tokens(100)},
            {"gate_type": "global-max-concurrency", "gate_params": {"limit": 1}},
        ]
    }
    gate = make("composite", params)
    assert any(isinstance(g, Settles) for g in walk(gate))
    first, second = req(30), req(30)
    assert gate.acquire(first).admitted
    refused = gate.acquire(second)  # charged by the quota, then the slot gate refused
    assert not refused.admitted
    inner = gate.gates[0]  # type: ignore[attr-defined]
    assert list(charges(genv, inner)) == [first.holder]  # the refused one was refunded
    settle(gate, first, 12)
    assert charges(genv, inner) == {first.holder: "12"}
    gate.release(first.holder)


def test_wrappers_pass_settle_through(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("wait-on-refuse", {"gate": {"gate_type": "redis-quota", "gate_params": tokens(50)}})
    assert any(isinstance(g, Settles) for g in walk(gate))
    a = req(50)
    assert gate.acquire(a).admitted
    assert gate.acquire(req(1)).verdict is Verdict.WAIT
    settle(gate, a, 10)
    assert gate.acquire(req(40)).admitted


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"mode": "tokens", "limit": 100}, "window"),
        ({"mode": "tokens", "limit": 0, "window": 60}, "limit"),
        ({"mode": "tokens", "limit": -5, "window": 60}, "limit"),
        ({"mode": "tokens", "limit": 100, "window": 0}, "window"),
        ({"mode": "tokens", "limit": 100, "window": 60, "default_max_tokens": -1}, "default_max"),
        ({"mode": "tokens", "limit": 100, "window": 60, "default_max_tokens": 1.5}, "default_max"),
        ({"mode": "concurrency", "limit": 2, "default_max_tokens": 10}, "default_max_tokens"),
        ({"limit": 2, "default_max_tokens": 10}, "default_max_tokens"),
    ],
)
def test_bad_tokens_params_are_config_errors_naming_the_field(
    params: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        build_gate("redis-quota", params, name="q")
