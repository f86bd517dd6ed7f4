"""Chaos: poison answers and poison requests mixed with good ones (issue 48: 4, 7, 8). 200s
nested past the parser, HTML pages, dropped connections and 503s, some for ever and some for
a while: every id ends with one terminal result, the server sees each request at most
``max_attempts`` times (no hot loop), never more than the gate's limit at once, and no gate
holds a reservation after (``pl``'s leak check)."""

from __future__ import annotations

import json
import uuid
from collections import Counter

from pipeline.client import Pipeline
from pipeline.sim import SimServer

# (fault mode, failing attempts, what it ends as); the "poison" queue: limit 2, 3 attempts
KINDS = [
    ("nested", 99, "MAX_ATTEMPTS_EXCEEDED"),
    ("html", 99, "MAX_ATTEMPTS_EXCEEDED"),
    ("drop", 99, "MAX_ATTEMPTS_EXCEEDED"),
    ("nested", 1, "ok"),
    ("truncated", 2, "ok"),
    ("status", 2, "ok"),
    ("ok", 0, "ok"),
]
EACH = 6


def test_poison_answers_never_loop_and_end_once(served: Pipeline, sim: SimServer) -> None:
    items, expected = [], {}
    for n, (mode, first, end) in enumerate(KINDS * EACH):
        rid = f"px-{mode}-{first}-{n}-{uuid.uuid4().hex[:6]}"
        headers = {"x-sim-latency-ms": "10"}
        if first:
            headers.update({"x-sim-fail-first": str(first), "x-sim-fail-mode": mode})
        items.append({"payload": {"n": n}, "id": rid, "queue": "poison", "timeout": 300,
                      "headers": headers})  # fmt: skip
        expected[rid] = (min(first + 1, 3), end)
    reqs = served.submit_many(items)
    results = {r.id: r for r in served.iter_results([r.id for r in reqs])}
    assert len(results) == len(items)
    calls = sim.stats()["attempts_by_request_id"]
    for rid, (attempts, end) in expected.items():
        r = results[rid]
        got = "ok" if r.ok else r.error_code
        assert (got, r.attempts, calls.get(rid)) == (end, attempts, attempts), (rid, r)
    assert sim.stats()["max_concurrency_observed"] <= 2
    # one terminal result per id on the queue's result list
    key = served.store.keys.result_list(served.settings.queues["poison"])
    pushed = Counter(json.loads(x)["id"] for x in served.store.client.lrange(key, 0, -1))
    assert all(pushed[rid] == 1 for rid in expected), pushed
    assert served.inspect()["poison"]["gate"]["in_flight"] == 0
