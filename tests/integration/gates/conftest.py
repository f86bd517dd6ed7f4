"""Fixtures for the gate tests: a real Redis (never a fake), one key prefix per test.

The suite fails (it does not skip) when Redis is not reachable at ``REDIS_URL`` (the test
run's: ``PIPELINE_TEST_REDIS_URL``, else its private server, tests/session_redis.py). After
each test no gate key under the test's prefix may still hold a slot (a holders sorted set or
an info hash that is not empty); then every key under the prefix is deleted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from pipeline.gates import AcquireContext, Gate, GateEnv, build_gate
from pipeline.store.keys import Keys
from tests.session_redis import session_redis_url

REDIS_URL = session_redis_url()
LEASE_S = 30.0


@pytest.fixture(scope="session")
def client() -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(REDIS_URL, decode_responses=True, socket_connect_timeout=2)
    try:
        c.ping()
    except redis.RedisError as exc:  # fail, never skip: these tests need the real server
        pytest.fail(f"Redis is required at {REDIS_URL}: {exc}", pytrace=False)
    yield c
    c.close()


def slot_keys(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Gate keys under ``prefix`` that still hold something: key → number of entries."""
    held = {}
    for key in client.scan_iter(match=f"{prefix}gate:*", count=10_000):
        if key.endswith(":holders") and client.type(key) == "zset":
            n = int(client.zcard(key))
        elif key.endswith(":info") and client.type(key) == "hash":
            n = int(client.hlen(key))
        else:
            continue
        if n:
            held[key] = n
    return held


@pytest.fixture
def genv(client: redis.Redis) -> Iterator[GateEnv]:
    keys = Keys(f"t{uuid.uuid4().hex[:12]}:")
    yield GateEnv(client=client, keys=keys, node="node-a")
    try:
        leftover = slot_keys(client, keys.prefix)
    finally:
        stale = list(client.scan_iter(match=f"{keys.prefix}*", count=10_000))
        if stale:
            client.delete(*stale)
    assert not leftover, f"gate slots still held after the test: {leftover}"


@pytest.fixture
def make(genv: GateEnv) -> Iterator[Callable[..., Gate]]:
    """Factory: build a gate bound to the test's env; every gate is closed afterwards."""
    built: list[Gate] = []

    def _make(gate_type: str, params: dict[str, Any] | None = None, name: str = "q") -> Gate:
        gate = build_gate(gate_type, params or {}, name=name, env=genv)
        built.append(gate)
        return gate

    yield _make
    for gate in built:
        gate.close()


_seq = iter(range(1, 1_000_000))


def ctx(
    request_id: str | None = None,
    token: str = "t1",
    *,
    lease_s: float = LEASE_S,
    metadata: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    worker: str = "w1",
) -> AcquireContext:
    """An acquire context; a fresh request id unless one is given."""
    now = time.time()
    return AcquireContext(
        request_id=request_id or f"r{next(_seq)}",
        token=token,
        queue="q",
        worker=worker,
        lease_s=lease_s,
        deadline=now + 600,
        metadata=metadata or {},
        labels=labels or {},
    )


def server_now(client: redis.Redis) -> float:
    """The Redis server's clock (Unix s): the one every lease is judged by."""
    sec, usec = client.time()
    return float(sec) + usec / 1e6


def lapse(genv: GateEnv, *holders: str) -> None:
    """Make ``holders``' leases expire now, as if their holders had crashed a lease period
    ago: each one's expiry is set 1 s in the past by the server's clock, in whichever of the
    test's slot pools holds it. (Gates judge expiry by the server's clock only, so a test
    cannot move time; it moves the lease.)"""
    past = f"{server_now(genv.client) - 1.0:.6f}"
    found = set()
    for key in genv.client.scan_iter(match=f"{genv.keys.prefix}gate:*:holders", count=10_000):
        for h in holders:
            if genv.client.zscore(key, h) is not None:
                genv.client.zadd(key, {h: past}, xx=True)
                found.add(h)
    assert found == set(holders), f"no lease to lapse for {set(holders) - found}"


def lease_expiry(genv: GateEnv, holder: str) -> float:
    """The holder's lease expiry (Unix s, server clock), from whichever pool holds it."""
    for key in genv.client.scan_iter(match=f"{genv.keys.prefix}gate:*:holders", count=10_000):
        score = genv.client.zscore(key, holder)
        if score is not None:
            return float(score)
    raise AssertionError(f"{holder} holds no lease")
