"""``redis-leased-rate``: a planner's leased admission rate, one token bucket in Redis shared by
every node, failing closed on any lease that is not valid. Against the real Redis (its clock
decides expiry and refill).

Then end to end: a planner (the last test) leases a pool-wide admission rate in Redis and
changes it mid-run; two real worker nodes share one token bucket, and the simulator — the
model server — sees each new rate within a second of the change."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.gates import Gate, GateEnv, Verdict, build_gate
from pipeline.gates.leased_rate import API_VERSION
from pipeline.sim import SimConfig, SimServer
from tests.conftest import CLUSTER, WorkerProc, assert_idle
from tests.observability import Isolated, isolated, scrape, start_node, total

from .conftest import ctx

DECIMAL = re.compile(r"^(\d+\.?\d*|\d*\.\d+)([eE][+-]?\d+)?$", re.ASCII)


def server_ms(client: redis.Redis) -> int:
    secs, micros = client.time()
    return int(secs) * 1000 + int(micros) // 1000


@pytest.fixture
def control(genv: GateEnv) -> str:
    return f"{genv.keys.prefix}ctrl:batch"


@pytest.fixture
def lease(genv: GateEnv, control: str) -> Callable[..., dict[str, str]]:
    """Write the planner's hash (fields may be overridden or removed with None)."""

    def write(rate: str = "10", ahead_ms: int = 60_000, **fields: str | None) -> dict[str, str]:
        data: dict[str, str | None] = {
            "api_version": API_VERSION,
            "pool_id": "batch",
            "max_admission_rps": rate,
            "valid_until_unix_ms": str(server_ms(genv.client) + ahead_ms),
            "decision_id": "d-1",
            **fields,
        }
        genv.client.delete(control)
        kept = {k: v for k, v in data.items() if v is not None}
        if kept:
            genv.client.hset(control, mapping=kept)
        return kept

    return write


@pytest.fixture
def gate(make: Callable[..., Gate], control: str) -> Gate:
    return make("redis-leased-rate", {"control_key": control, "pool_id": "batch"})


def admitted(gate: Gate, n: int) -> int:
    return sum(gate.acquire(ctx()).admitted for _ in range(n))


def test_a_valid_lease_admits_a_burst_then_the_rate(
    gate: Gate, lease: Callable[..., dict[str, str]], genv: GateEnv
) -> None:
    lease(rate="4", ahead_ms=60_000)  # burst_seconds 1: capacity 4
    assert gate.budget() == 1.0
    assert admitted(gate, 6) == 4  # the full bucket, then no token
    refused = gate.acquire(ctx())
    assert (refused.verdict, refused.reason) == (Verdict.REFUSE, "gate_closed")
    assert gate.budget() == 1.0  # the lease is valid: budget does not look at the bucket
    wait_until(
        lambda: gate.acquire(ctx()).admitted, 2, "gate.acquire(ctx()).admitted"
    )  # refilled at 4/s
    assert (gate.limit_rps, gate.lease_valid) == (4.0, 1)
    assert gate.valid_until_s > server_ms(genv.client) / 1000
    state = genv.client.hgetall(gate.state_key)
    assert float(state["tokens"]) < 1 and state["decision_id"] == "d-1"
    assert 0 < genv.client.pttl(gate.state_key) <= 61_000


def test_burst_seconds_sizes_the_bucket(
    make: Callable[..., Gate], control: str, lease: Callable[..., dict[str, str]]
) -> None:
    lease(rate="2")
    gate = make("redis-leased-rate", {"control_key": control, "pool_id": "batch",
                                      "burst_seconds": "3"})  # fmt: skip
    assert admitted(gate, 10) == 6
    tiny_params = {"control_key": control, "pool_id": "batch", "burst_seconds": 0.01}
    tiny = make("redis-leased-rate", {**tiny_params, "state_key": control + ":tiny"})
    assert admitted(tiny, 3) == 1  # at least one token, whatever the product


def test_every_node_shares_one_bucket(
    genv: GateEnv, control: str, lease: Callable[..., dict[str, str]]
) -> None:
    lease(rate="5")
    params = {"control_key": control, "pool_id": "batch"}
    nodes = [
        build_gate(
            "redis-leased-rate", params, name="q", env=GateEnv(genv.client, genv.keys, node=n)
        )
        for n in ("a", "b", "c")
    ]
    assert sum(admitted(g, 4) for g in nodes) == 5


def test_rate_zero_pauses(gate: Gate, lease: Callable[..., dict[str, str]]) -> None:
    lease(rate="0")
    assert gate.budget() == 0.0
    assert admitted(gate, 3) == 0
    assert (gate.limit_rps, gate.lease_valid) == (0.0, 1)  # paused, but a valid lease
    lease(rate="50")
    assert gate.budget() == 1.0 and gate.acquire(ctx()).admitted


@pytest.mark.parametrize(
    "fields",
    [
        {"api_version": "llm-d.ai/v1"},
        {"pool_id": "other-pool"},
        {"api_version": None},
        {"pool_id": None},
        {"max_admission_rps": None},
        {"valid_until_unix_ms": None},
        {"decision_id": None},
        {"decision_id": ""},
        {"max_admission_rps": ""},
        {"valid_until_unix_ms": "1.5e15"},
        {"valid_until_unix_ms": "soon"},
    ],
)
def test_a_mismatched_or_incomplete_lease_refuses_and_creates_no_state(
    gate: Gate, lease: Callable[..., dict[str, str]], genv: GateEnv, fields: dict[str, Any]
) -> None:
    lease(**fields)
    assert gate.budget() == 0.0
    assert not gate.acquire(ctx()).admitted
    assert (gate.limit_rps, gate.lease_valid, gate.valid_until_s) == (0.0, 0, 0.0)
    assert not genv.client.exists(gate.state_key)


def test_a_missing_or_expired_lease_refuses(
    gate: Gate, lease: Callable[..., dict[str, str]], genv: GateEnv, control: str
) -> None:
    assert not gate.acquire(ctx()).admitted and gate.budget() == 0.0  # no hash at all
    lease(ahead_ms=-1)  # the Redis clock has passed it
    assert not gate.acquire(ctx()).admitted
    lease(ahead_ms=60_000)
    assert gate.acquire(ctx()).admitted
    genv.client.pexpire(control, 1)  # the planner's own TTL on the hash: gone reads as missing
    wait_until(lambda: not genv.client.exists(control), 5, "not genv.client.exists(control)")
    assert not gate.acquire(ctx()).admitted and gate.lease_valid == 0


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rate=st.one_of(st.from_regex(DECIMAL, fullmatch=True), st.text(max_size=12)))
def test_only_a_plain_finite_non_negative_rate_is_a_lease(
    gate: Gate, lease: Callable[..., dict[str, str]], rate: str
) -> None:
    """Any text that is not a plain decimal (hex, inf, nan, signs, spaces, words) refuses;
    a plain finite decimal is a valid lease (paused when it is 0)."""
    lease(rate=rate)
    plain = bool(DECIMAL.match(rate)) and float(rate) < float("inf")
    assert gate.budget() == (1.0 if plain and float(rate) > 0 else 0.0), rate
    assert gate.lease_valid == (1 if plain else 0), rate
    if plain:
        assert gate.limit_rps == pytest.approx(float(rate))


def test_a_redis_error_refuses_with_reason_error(make: Callable[..., Gate], control: str) -> None:
    gate = make("redis-leased-rate", {"control_key": control, "pool_id": "batch",
                                      "address": "127.0.0.1:9"})  # fmt: skip
    decision = gate.acquire(ctx())
    assert (decision.verdict, decision.reason) == (Verdict.REFUSE, "error")
    assert gate.budget() == 0.0 and gate.lease_valid == 0


def test_nothing_to_release_renew_or_reap(
    gate: Gate, lease: Callable[..., dict[str, str]], genv: GateEnv
) -> None:
    lease(rate="1")
    a = ctx()
    assert gate.acquire(a).admitted
    gate.renew([a.holder], a.lease_s)
    assert gate.release(a.holder) is False
    assert gate.reap() == []
    assert gate.in_flight() == 0 and gate.holders() == [] and gate.capacity() is None
    assert not gate.acquire(ctx()).admitted  # the spent token was not refunded


def test_a_composite_rolls_back_its_other_members_when_the_rate_refuses(
    make: Callable[..., Gate], control: str, lease: Callable[..., dict[str, str]]
) -> None:
    rate = {"gate_type": "redis-leased-rate",
            "gate_params": {"control_key": control, "pool_id": "batch"}}  # fmt: skip
    slot = {"gate_type": "global-max-concurrency", "gate_params": {"limit": 2}}
    gate = make("composite", {"gates": [slot, rate]})
    lease(rate="0")  # paused: the slot taken first is given back
    assert not gate.acquire(ctx()).admitted
    assert gate.in_flight() == 0
    lease(rate="1")
    a = ctx()
    assert gate.acquire(a).admitted and gate.in_flight() == 1
    assert not gate.acquire(ctx()).admitted  # the bucket is empty: rolled back again
    assert gate.in_flight() == 1
    assert gate.release(a.holder) is True and gate.in_flight() == 0
    # the other order: the rate admits, then the full slot gate refuses; the token is spent
    fresh = {**rate, "gate_params": {**rate["gate_params"], "state_key": control + ":2"}}
    one = {"gate_type": "global-max-concurrency", "gate_params": {"limit": 1}}
    full = make("composite", {"gates": [fresh, one]}, name="f")
    lease(rate="2")
    b = ctx()
    assert full.acquire(b).admitted
    assert not full.acquire(ctx()).admitted  # a token taken, the slot full: nothing held
    assert full.in_flight() == 1
    full.release(b.holder)


def test_wait_on_refuse_parks_instead_of_requeueing(
    make: Callable[..., Gate], control: str, lease: Callable[..., dict[str, str]]
) -> None:
    inner = {"gate_type": "redis-leased-rate", "gate_params": {"control_key": control}}
    gate = make("wait-on-refuse", {"gate": inner}, name="pool.batch")  # pool_id from the pool
    lease(rate="0")
    assert gate.acquire(ctx()).verdict is Verdict.WAIT
    lease(rate="5")
    assert gate.acquire(ctx()).admitted


# -- end to end: a planner, two worker nodes and the simulator ------------------------------
BURST_S = 0.5
# (rate req/s, seconds it stays); the last phase lets the rest finish
PHASES = [(4.0, 3.0), (16.0, 3.0), (0.0, 2.0), (60.0, 0.0)]


@pytest.fixture
def rate_sim() -> Iterator[SimServer]:
    server = SimServer(SimConfig(latency_ms=20, record_arrivals=True)).start_in_thread()
    yield server
    server.stop()


def leased_iso(env: dict[str, str], sim: SimServer, tmp: Path) -> tuple[Isolated, str]:
    """An isolated pipeline whose worker pool's gate is wait-on-refuse(redis-leased-rate)."""
    iso = isolated(env, tmp, [{"queue_name": "batch", "igw_base_url": sim.url}])
    control = f"{iso.env['PIPELINE_KEY_PREFIX']}planner:{iso.pool()}"
    if CLUSTER:  # the planner's key in the pool's slot
        control += f"{{p:{iso.pool()}}}"
    leased = {"gate_type": "redis-leased-rate",
              "gate_params": {"control_key": control, "burst_seconds": BURST_S}}  # fmt: skip
    pools = tmp / f"pools-{iso.tag}.json"
    pools.write_text(json.dumps([{"id": iso.pool(), "workers": 16, "gate_type": "wait-on-refuse",
                                  "gate_params": {"gate": leased}}]))  # fmt: skip
    e = {**iso.env, "PIPELINE_POOLS": str(pools), "PIPELINE_GATE_WAIT_TIMEOUT_S": "30"}
    settings = load_settings(e)
    return Isolated(e, settings, Pipeline(settings), iso.tag), control


class Planner(threading.Thread):
    """Writes the lease hash for each phase and records when (monotonic s) it did."""

    def __init__(self, client: redis.Redis, control: str, pool: str) -> None:
        super().__init__(daemon=True)
        self.client, self.control, self.pool = client, control, pool
        self.changes: list[tuple[float, float]] = []  # (monotonic s, rate)

    def lease(self, rate: float, decision: str) -> None:
        secs, micros = self.client.time()
        until = int(secs) * 1000 + int(micros) // 1000 + 120_000
        self.client.hset(self.control, mapping={
            "api_version": API_VERSION, "pool_id": self.pool, "max_admission_rps": f"{rate:g}",
            "valid_until_unix_ms": str(until), "decision_id": decision,
        })  # fmt: skip
        self.changes.append((time.monotonic(), rate))

    def run(self) -> None:
        for i, (rate, hold_s) in enumerate(PHASES):
            self.lease(rate, f"d-{i}")
            time.sleep(hold_s)  # the planner's schedule: each decision holds this long


def test_a_planner_changes_the_pool_rate_mid_run(
    env: dict[str, str],
    rate_sim: SimServer,
    tmp_path: Path,
    start_worker: Callable[..., WorkerProc],
) -> None:
    iso, control = leased_iso(env, rate_sim, tmp_path)
    client = iso.pl.store.client
    nodes = [start_node(start_worker, iso, concurrency=8) for _ in range(2)]
    try:
        ids = [r.id for r in iso.pl.submit_many(
            [{"payload": {"prompt": f"p{i}", "max_tokens": 1}, "queue": iso.queue("batch")}
             for i in range(170)]
        )]  # fmt: skip
        planner = Planner(client, control, iso.pool())
        planner.start()
        planner.join(timeout=30)
        for rid in ids:
            assert iso.pl.wait(rid, timeout=60).ok
        arrivals = sorted(a for a, _, _ in httpx.get(rate_sim.url + "/sim/arrivals").json())
        assert len(arrivals) == len(ids)
        changes = planner.changes
        for (start, rate), (end, _) in zip(changes, changes[1:], strict=False):
            # from one second after the change to the next change: the new rate
            window = end - (start + 1.0)
            seen = sum(start + 1.0 <= a < end for a in arrivals)
            capacity = max(1.0, rate * BURST_S)
            assert seen <= rate * window + capacity + 1, (rate, seen, window)
            assert seen >= 0.5 * rate * window, (rate, seen, window)
        # the whole run never beat the leased rates: bucket capacity + rate x time per phase
        for (start, rate), (end, _) in zip(changes, changes[1:], strict=False):
            seen = sum(start <= a < end for a in arrivals)
            assert seen <= rate * (end - start) + max(1.0, rate * BURST_S) + 16, (rate, seen)
        # the gauges, read from the planner's hash at scrape time
        samples = scrape(nodes[0][1])
        assert total(samples, "pipeline_drain_limit_rps", pool_name=iso.pool()) == 60
        assert total(samples, "pipeline_drain_limit_lease_valid", pool_name=iso.pool()) == 1
        until = total(samples, "pipeline_drain_limit_valid_until_seconds", pool_name=iso.pool())
        assert until > time.time() + 60
        client.delete(control)  # the lease is gone: every gauge reads 0
        samples = scrape(nodes[0][1])
        assert total(samples, "pipeline_drain_limit_lease_valid", pool_name=iso.pool()) == 0
        assert total(samples, "pipeline_drain_limit_rps", pool_name=iso.pool()) == 0
        assert_idle(iso.pl)
    finally:
        client.delete(control)
        for w, _ in nodes:
            w.stop()
