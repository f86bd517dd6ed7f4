"""redis gate: a budget read from a key another system writes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from pipeline.gates import Gate, GateEnv, Verdict

from .conftest import REDIS_URL, ctx


def test_budget_follows_the_key(genv: GateEnv, make: Callable[..., Gate]) -> None:
    key = f"{genv.keys.prefix}budget"
    gate = make("redis", {"budget_key": key})
    assert gate.budget() == 1.0  # missing key: open
    assert gate.acquire(ctx()).admitted
    genv.client.set(key, "0.25")
    assert gate.budget() == 0.25 and gate.acquire(ctx()).admitted
    genv.client.set(key, "0")
    assert gate.budget() == 0.0
    closed = gate.acquire(ctx())
    assert (closed.verdict, closed.reason) == (Verdict.REFUSE, "gate_closed")
    genv.client.set(key, "7")
    assert gate.budget() == 1.0  # clamped
    genv.client.set(key, "-2")
    assert gate.budget() == 0.0
    genv.client.set(key, "0.5")
    assert gate.acquire(ctx()).admitted  # resumes
    assert gate.in_flight() == 0 and gate.release("x:y") is False


def test_unparsable_value_fails_closed_with_a_warning(
    genv: GateEnv, make: Callable[..., Gate], caplog: pytest.LogCaptureFixture
) -> None:
    key = f"{genv.keys.prefix}budget"
    genv.client.set(key, "lots")
    gate = make("redis", {"budget_key": key})
    with caplog.at_level(logging.WARNING):
        assert gate.budget() == 0.0
        assert gate.budget() == 0.0
    assert sum("not a number" in r.getMessage() for r in caplog.records) == 1  # once
    genv.client.set(key, "nan")
    assert gate.budget() == 0.0


def test_redis_error_fails_closed_and_hides_the_password(
    make: Callable[..., Gate], caplog: pytest.LogCaptureFixture
) -> None:
    gate = make("redis", {"address": "redis://:s3cret@127.0.0.1:1/0"})
    with caplog.at_level(logging.WARNING):
        assert gate.budget() == 0.0
    assert not gate.acquire(ctx()).admitted
    assert caplog.records and all("s3cret" not in r.getMessage() for r in caplog.records)


def test_address_names_another_redis(genv: GateEnv, make: Callable[..., Gate]) -> None:
    key = f"{genv.keys.prefix}budget"
    genv.client.set(key, "0.75")
    gate = make("redis", {"address": REDIS_URL.removeprefix("redis://"), "budget_key": key})
    assert gate.budget() == 0.75
