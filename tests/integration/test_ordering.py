"""Dispatch order: priority (higher first), then earliest deadline, then submission order."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline, ordering_score
from pipeline.sim import SimServer
from tests.conftest import held


@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.floats(1.7e9, 4.0e9, allow_nan=False)),
        min_size=2,
        max_size=30,
    )
)
def test_score_orders_by_priority_then_deadline(items: list[tuple[int, float]]) -> None:
    by_score = sorted(range(len(items)), key=lambda i: (ordering_score(*items[i]), i))
    expected = sorted(range(len(items)), key=lambda i: (-items[i][0], round(items[i][1] * 1000), i))
    assert by_score == expected


def test_exact_order_with_one_worker_slot(pl: Pipeline, sim: SimServer, start_worker: Any) -> None:
    rng = random.Random(3)
    now = time.time()
    items = []
    for i in range(50):
        priority = rng.choice([0, 0, 1, 5, 9])
        # some share a deadline exactly, so submission order must break the tie
        deadline = now + 60 + rng.choice([0, 0, 5, 10, 30]) + (i % 3)
        items.append(
            {
                "payload": {"prompt": f"o{i}"},
                "id": f"ord-{uuid.uuid4().hex[:8]}-{i}",
                "queue": "solo",
                "priority": priority,
                "deadline": deadline,
            }
        )
    reqs = pl.submit_many(items)
    expected = [
        it["id"]
        for _, it in sorted(
            enumerate(items),
            key=lambda p: (-p[1]["priority"], round(p[1]["deadline"] * 1000), p[0]),
        )
    ]
    w = start_worker(pools="solo", concurrency=1)
    try:
        results = list(pl.iter_results([r.id for r in reqs]))
        assert all(r.ok for r in results)
    finally:
        w.stop()
    seen = [
        rid
        for _a, _f, rid in httpx.get(f"{sim.url}/sim/arrivals").json()
        if rid and rid.startswith("ord-")
    ]
    assert seen == expected


def test_ordering_keeps_retries_after_backoff(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    """A retried request re-enters with its original key, but only after its backoff. The
    high-priority request fails its first attempt (Retry-After 2 s); the lower-priority ones
    submitted during its backoff start flowing, the first of them held at the simulator in
    the node's only slot, so the rest are still waiting when the retry becomes due: it goes
    ahead of them all, and the arrivals show the order without racing the backoff."""
    first = pl.submit(
        {"prompt": "a"},
        id=f"rt-{uuid.uuid4().hex[:6]}",
        queue="solo",
        priority=9,
        timeout=60,
        headers={"x-sim-fail-first": "1", "x-sim-fail-status": "503", "x-sim-retry-after": "2"},
    )
    hold = f"rt-hold-{uuid.uuid4().hex[:6]}"
    w = start_worker(pools="solo", concurrency=1)
    try:
        wait_until(lambda: first.state() == "retry_wait", 20, "the first attempt's 503")
        others = [
            pl.submit(
                {"prompt": f"b{i}"},
                id=f"rt-{uuid.uuid4().hex[:6]}",
                queue="solo",
                priority=1,
                timeout=60,
                headers=held(hold) if i == 0 else None,
            )
            for i in range(5)
        ]
        sim.wait_held(hold)  # dispatched during the backoff, in the only slot
        wait_until(lambda: first.state() == "queued", 20, "the retry due, back in its queue")
        sim.release(hold)
        assert first.result(timeout=20).ok
        assert all(o.result(timeout=20).ok for o in others)
    finally:
        w.stop()
    seen = [
        rid
        for _a, _f, rid in httpx.get(f"{sim.url}/sim/arrivals").json()
        if rid and rid.startswith("rt-")
    ]
    # attempt 1 of the high-priority request, the held one that ran during its backoff, then
    # the retry with its original key ahead of the lower-priority rest
    assert seen == [first.id, others[0].id, first.id] + [o.id for o in others[1:]]
    wait_until(lambda: pl.inspect()["solo"]["running"] == 0, 5, "solo idle")
