"""One clock: every time the scripts store or compare is the Redis server's (``TIME``), and
callers hand them durations. (Nodes with skewed clocks, end to end: tests/chaos/
test_clock_skew.py.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.client import Pipeline, ordering_score
from pipeline.store import Store


def server_now(store: Store) -> float:
    sec, usec = store.client.time()
    return sec + usec / 1e6


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    priority=st.integers(0, 9),
    ahead=st.floats(1.0, 10 * 365 * 24 * 3600.0 - 10, allow_nan=False),
)
def test_the_ordering_key_is_the_one_submit_computes(
    pl: Pipeline, priority: int, ahead: float
) -> None:
    deadline = server_now(pl.store) + ahead
    req = pl.submit({"x": 1}, queue="solo", priority=priority, deadline=deadline)
    record = pl.store.record(req.id)
    assert float(record["score"]) == ordering_score(priority, float(record["deadline"]))
    assert float(record["deadline"]) == pytest.approx(deadline, abs=1e-6)  # kept as given
    assert pl.cancel(req.id)


def test_submit_times_and_relative_deadlines_are_the_servers(pl: Pipeline) -> None:
    before = server_now(pl.store)
    req = pl.submit({"x": 1}, queue="solo", timeout=42)
    after = server_now(pl.store)
    record = pl.store.record(req.id)
    submitted = float(record["submitted_at"])
    assert before <= submitted <= after
    assert float(record["deadline"]) - submitted == pytest.approx(42, abs=1e-5)
    assert pl.cancel(req.id)
    result = req.result(timeout=5)
    assert before <= result.finished_at <= server_now(pl.store) + 0.001


def test_an_attempts_lease_ends_on_a_whole_second_of_the_servers_clock(pl: Pipeline) -> None:
    """Dispatch and start write the lease rounded up to a whole second (lib.lua lease_score):
    an integer score, never before now + the lease, at most a second after it."""
    q, store = pl.settings.queues["solo"], pl.store
    req = pl.submit({"x": 1}, queue="solo", timeout=300)
    before = server_now(store)
    (moved,) = store.tick(q, [q], 1.0, -1, 1).moved
    lease = store.client.zscore(store.keys.active("solo"), req.id)
    assert lease == int(lease)
    assert before + pl.settings.dispatch_lease_s <= lease
    assert lease <= server_now(store) + pl.settings.dispatch_lease_s + 1
    before = server_now(store)
    assert store.start(req.id, moved.token, "solo", "w@test") is not None
    lease = store.client.zscore(store.keys.active("solo"), req.id)
    assert lease == int(lease)
    assert before + pl.settings.lease_s <= lease <= server_now(store) + pl.settings.lease_s + 1
    assert store.finish(req.id, moved.token, attempted=False, status_code=200, payload="{}")


def test_a_ticks_next_event_is_a_delay(pl: Pipeline) -> None:
    q = pl.settings.queues["solo"]
    req = pl.submit({"x": 1}, queue="solo", timeout=300)
    res = pl.store.tick(q, [q], 0.0, -1, 0)  # a closed gate: nothing moves
    assert res.moved == [] and res.next_event is not None
    assert 0 < res.next_event <= 300  # seconds from now (the earliest deadline), not a time
    assert pl.cancel(req.id)


def test_a_node_that_stops_beating_leaves_the_pool_registry(pl: Pipeline) -> None:
    store, pool = pl.store, "beat-test"
    ((total, live),) = store.node_beat("node-b", 8, [pool], 30)
    assert (total, live) == (8, 1)
    # node a's liveness already lapsed (a node that died): it is dropped in the same step
    ((total, live),) = store.node_beat("node-a", 4, [pool], -1)
    assert (total, live) == (8, 1)
    assert store.client.hkeys(store.keys.pool_slots(pool)) == ["node-b"]
    store.client.delete(store.keys.pool_slots(pool), store.keys.pool_nodes(pool))
