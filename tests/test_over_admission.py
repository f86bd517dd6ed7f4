"""Invariant 2: the model server never sees more requests at once than the gate's limit, across
several worker nodes, including while leases are renewed (leases shorter than the requests)."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest

from pipeline.client import Pipeline
from pipeline.sim import SimServer

LIMIT = 5  # the "overadmit" queue: redis-quota, mode concurrency, limit 5 per userid


def run_load(pl: Pipeline, n: int, latency_ms: int, fail_share: float) -> None:
    rng = random.Random(11)
    items = []
    for i in range(n):
        headers = {"x-sim-latency-ms": str(latency_ms)}
        if rng.random() < fail_share:
            headers.update({"x-sim-fail-first": "1", "x-sim-fail-status": "503"})
        items.append(
            {
                "payload": {"i": i},
                "id": f"oa-{uuid.uuid4().hex[:8]}",
                "timeout": 120,
                "queue": "overadmit",
                "metadata": {"userid": "tenant-a"},
                "headers": headers,
            }
        )
    reqs = pl.submit_many(items)
    results = list(pl.iter_results([r.id for r in reqs]))
    assert len(results) == n and all(r.ok for r in results)


@pytest.mark.parametrize(
    ("lease_s", "n", "latency_ms"),
    [("30", 300, 30), ("0.4", 40, 800)],
    ids=["default-leases", "leases-shorter-than-requests"],
)
def test_three_nodes_never_exceed_the_limit(
    pl: Pipeline, sim: SimServer, start_worker: Any, lease_s: str, n: int, latency_ms: int
) -> None:
    extra = {"PIPELINE_LEASE_S": lease_s, "PIPELINE_REAPER_PERIOD_S": "0.2"}
    workers = [start_worker(pools="overadmit", concurrency=16, extra_env=extra) for _ in range(3)]
    try:
        sim.reset()
        run_load(pl, n, latency_ms, fail_share=0.2)
        stats = sim.stats()
        assert stats["max_concurrency_observed"] <= LIMIT, stats
        assert stats["max_concurrency_observed"] == LIMIT, stats  # and the limit is used
        assert pl.inspect()["overadmit"]["gate"]["in_flight"] == 0
    finally:
        for w in workers:
            w.stop()
