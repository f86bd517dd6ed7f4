"""Chaos: the model server stalls (never answers) and drops connections. Attempts time out,
retry within the deadline, and nothing wedges: the gate's in-flight count returns to 0."""

from __future__ import annotations

import random
import uuid

from pipeline.client import Pipeline


def test_stalls_and_drops_retry_and_nothing_wedges(served: Pipeline) -> None:
    # "stalls": redis-quota concurrency 4 per tenant, attempts cut off after 0.4 s
    rng = random.Random(9)
    items = []
    for i in range(40):
        mode = rng.choice(["stall", "drop", "ok"])
        headers = {"x-sim-latency-ms": "20"}
        if mode != "ok":
            headers.update({"x-sim-fail-first": str(rng.randint(1, 2)), "x-sim-fail-mode": mode})
        items.append(
            {
                "payload": {"i": i},
                "id": f"st-{mode}-{uuid.uuid4().hex[:6]}",
                "queue": "stalls",
                "timeout": 60,
                "metadata": {"userid": "stall-tenant"},
                "headers": headers,
            }
        )
    reqs = served.submit_many(items)
    results = {r.id: r for r in served.iter_results([r.id for r in reqs])}
    assert len(results) == 40 and all(r.ok for r in results.values()), [
        (r.id, r.error_code, r.error_message) for r in results.values() if not r.ok
    ]
    for rid, r in results.items():
        if "-ok-" not in rid:
            assert r.attempts >= 2  # the stalled/dropped attempts were retried
    info = served.inspect()
    assert info["stalls"]["gate"]["in_flight"] == 0
