"""Merge policies across a pool's queues, with the real dispatch script (one atomic tick per
pool) and the merge state it keeps in Redis (``Keys.merge``):

- ``random-robin``: backlogged queues share the dispatches in proportion to their ``weight``,
  smoothly (a smooth weighted round-robin from a random start): each of two equal queues has
  50 % ± 10 % of *any* 40 consecutive dispatches, whatever the tick sizes; 3:1 → 75 % ± 10 %.
  A queue with nothing to send or no room takes no turn, and one that joins late is served
  at once, not after the others' backlog.
- ``tier-priority``: the highest lane with something to send goes first, round-robin among
  its queues, but a lower lane with something to send is passed over at most ``max_wait``
  dispatches in a row.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import MergePolicy, parse_merge_policy
from pipeline.errors import ConfigError
from pipeline.store import MergeArgs

from .sched_harness import Bench, bench


def backlog(b: Bench, queue: str, n: int) -> None:
    deadline = time.time() + 3600
    b.pl.submit_many([{"payload": {}, "queue": queue, "deadline": deadline} for _ in range(n)])


def run(
    b: Bench,
    queues: dict[str, dict[str, Any]],
    sizes: list[int],
    total: int,
    merge: MergeArgs | None = None,
) -> list[str]:
    """Dispatch ``total`` requests in ticks of the given sizes (cycled); the queue of each."""
    order: list[str] = []
    i = 0
    while len(order) < total:
        res = b.tick(queues, sizes[i % len(sizes)], merge)
        assert res.moved, "a tick with room and backlogged queues moved nothing"
        order += [d.queue for d in res.moved]
        i += 1
    return order[:total]


def shares(order: list[str], queue: str, window: int) -> list[int]:
    return [order[i : i + window].count(queue) for i in range(len(order) - window + 1)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8),
    starts=st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)),
    weights=st.sampled_from([(1, 1), (3, 1)]),
)
def test_random_robin_is_smooth_in_every_window(
    redis_url: str, sizes: list[int], starts: tuple[float, float], weights: tuple[int, int]
) -> None:
    queues = [
        {"queue_name": "a", "weight": weights[0]},
        {"queue_name": "b", "weight": weights[1]},
    ]
    with bench(redis_url, queues) as b:
        backlog(b, "a", 260)
        backlog(b, "b", 260)
        order = run(b, {"a": {"rand": starts[0]}, "b": {"rand": starts[1]}}, sizes, 240)
    expected = 40 * weights[0] / sum(weights)  # 20 of 40, or 30 of 40
    counts = shares(order, "a", 40)
    assert min(counts) >= expected - 4 and max(counts) <= expected + 4, counts


def test_the_first_queue_no_longer_starves_the_second(redis_url: str) -> None:
    """The issue's measurement: two backlogged queues, one free slot at a time: the first
    queue in the file got 20 dispatches and the second 0. Now they alternate."""
    with bench(redis_url, [{"queue_name": "a"}, {"queue_name": "b"}]) as b:
        backlog(b, "a", 30)
        backlog(b, "b", 30)
        order = run(b, {"a": {}, "b": {}}, [1], 20)
        assert order.count("a") == order.count("b") == 10


def test_a_queue_without_work_or_room_takes_no_turn(redis_url: str) -> None:
    qs = [{"queue_name": "a"}, {"queue_name": "b"}, {"queue_name": "c"}]
    with bench(redis_url, qs) as b:
        backlog(b, "a", 40)
        backlog(b, "c", 3)
        # b is empty and c's gate has room for 3 only: a gets every other dispatch
        order = run(b, {"a": {}, "b": {}, "c": {"cap": 3}}, [2], 12)
        assert order.count("c") == 3 and order.count("b") == 0
        assert order[:6].count("a") == 3  # c's turns while it had room
        # b joins late with a backlog: it is served at once, then every other dispatch
        backlog(b, "b", 40)
        later = run(b, {"a": {}, "b": {}, "c": {"cap": 3}}, [1], 10)
        assert "b" in later[:2] and later.count("b") == 5


def test_tier_priority_serves_lanes_in_order_without_starving_the_lower(redis_url: str) -> None:
    qs = [
        {"queue_name": "hi1", "labels": {"tier": "interactive", "classification": "reserved"}},
        {"queue_name": "hi2", "labels": {"tier": "interactive", "classification": "reserved"}},
        {"queue_name": "mid", "labels": {"tier": "async"}},  # overflow-async: lane 4
        {"queue_name": "low"},  # no labels: overflow-batch, lane 5
    ]
    policy = MergePolicy(type="tier-priority")
    with bench(redis_url, qs, policy) as b:
        lanes = {q: policy.lane(b.pl.settings.queues[q].labels) for q in ("hi1", "mid", "low")}
        assert lanes == {"hi1": 0, "mid": 4, "low": 5}
        for q in ("hi1", "hi2", "mid", "low"):
            backlog(b, q, 120)
        entries: dict[str, dict[str, Any]] = {
            q: {"lane": policy.lane(b.pl.settings.queues[q].labels)}
            for q in ("hi1", "hi2", "mid", "low")
        }
        merge = MergeArgs("tier-priority", max_wait=15)
        order = run(b, entries, [1, 3, 2], 200, merge)
    top = [q for q in order if q in ("hi1", "hi2")]
    assert len(top) >= 0.8 * len(order)  # the top lane keeps most of the pool
    assert abs(top.count("hi1") - top.count("hi2")) <= 1  # round-robin inside the lane
    for lower in ("mid", "low"):
        # passed over at most 15 times in a row (+1 for the other lower lane's turn)
        assert min(shares(order, lower, 17)) >= 1, lower
    assert order[:15].count("hi1") + order[:15].count("hi2") == 15  # strict until then


def test_strict_lanes_when_the_wait_is_unbounded(redis_url: str) -> None:
    qs = [{"queue_name": "hi", "labels": {"tier": "interactive"}}, {"queue_name": "low"}]
    policy = MergePolicy(type="tier-priority", max_lane_wait=10**6)
    with bench(redis_url, qs, policy) as b:
        backlog(b, "hi", 50)
        backlog(b, "low", 50)
        entries = {"hi": {"lane": 3}, "low": {"lane": 5}}
        order = run(b, entries, [4], 60, MergeArgs("tier-priority", 10**6))
    assert order[:50] == ["hi"] * 50 and order[50:] == ["low"] * 10


def test_lane_headers() -> None:
    policy = parse_merge_policy(
        {
            "type": "tier-priority",
            "parameters": {
                "priority_header": "x-gateway-priority",
                "lane_objectives": {"reserved-interactive": "premium", "overflow-batch": "cheap"},
            },
        },
        "merge.json",
    )
    reserved = {"tier": "interactive", "classification": "reserved"}
    assert policy.headers(reserved) == {
        "x-gateway-priority": "0",
        "x-llm-d-inference-objective": "premium",
    }
    assert policy.headers({}) == {"x-gateway-priority": "5", "x-llm-d-inference-objective": "cheap"}
    assert policy.headers({"tier": "async"}) == {"x-gateway-priority": "4"}
    assert MergePolicy().headers(reserved) == {}  # random-robin stamps nothing


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"type": "round-robin"}, "type"),
        ({"type": "random-robin", "params": {}}, "params"),
        ({"type": "random-robin", "parameters": {"priority_header": "x"}}, "priority_header"),
        ({"type": "tier-priority", "parameters": {"lane_objectives": {"vip": "a"}}}, "vip"),
        ({"type": "tier-priority", "parameters": {"objective_header": "bad header"}}, "objective"),
        ({"type": "tier-priority", "parameters": {"max_lane_wait": -1}}, "max_lane_wait"),
        ({"type": "tier-priority", "parameters": {"max_lane_wait": True}}, "max_lane_wait"),
        ({"type": "random-robin", "parameters": {"fairness_header": "a b"}}, "fairness_header"),
        ([], "object"),
    ],
)
def test_a_bad_merge_policy_is_refused_naming_the_field(data: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_merge_policy(data, "merge.json")


@pytest.mark.parametrize(
    ("field", "value"),
    [("weight", 0), ("weight", -1), ("weight", "2"), ("weight", True), ("fair_share", "yes")],
)
def test_bad_scheduling_fields_of_a_queue_name_the_field(field: str, value: Any) -> None:
    from pipeline.config import parse_queues

    entry = {"queue_name": "a", "igw_base_url": "http://x", field: value}
    with pytest.raises(ConfigError, match=field):
        parse_queues([entry], "queues.json")


def test_the_merge_policy_file_is_read_at_startup(tmp_path: Any) -> None:
    from pipeline.config import load_settings

    f = tmp_path / "merge.json"
    f.write_text('{"type": "tier-priority", "parameters": {"fairness_attribute": "team"}}')
    s = load_settings({"PIPELINE_MERGE_POLICY": str(f)})
    assert s.merge_policy.tiered and s.fairness_attribute == "team"
    f.write_text('{"type": "tier-priority", "extra": 1}')
    with pytest.raises(ConfigError, match="extra"):
        load_settings({"PIPELINE_MERGE_POLICY": str(f)})
    assert load_settings({}).merge_policy == MergePolicy()
