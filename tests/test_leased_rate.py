"""The ``redis-leased-rate`` gate end to end: a planner (this test) leases a pool-wide
admission rate in Redis and changes it mid-run; two real worker nodes share one token bucket,
and the simulator — the model server — sees each new rate within a second of the change."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.gates.leased_rate import API_VERSION
from pipeline.sim import SimConfig, SimServer
from tests.conftest import WorkerProc, assert_idle
from tests.observability import Isolated, isolated, scrape, start_node, total

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
