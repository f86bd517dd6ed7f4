"""Prefix-grouped dispatch (docs/scheduling.md, "Prefix grouping"), with the real dispatch
script: a request that shares its prompt prefix with the one just sent may go ahead of the
head of its queue, only at the head's priority and only while the head's deadline is more
than the queue's slack (``group_slack_s``) away; with no slack, the order is exactly the
pending set's. Ticks are driven by hand (no workers): each dispatch is a tick's move."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.client.explain import describe_entry
from pipeline.client.prefix import MIN_CHARS, PREFIX_CHARS, prefix_key
from pipeline.config import QueueConfig
from pipeline.sim import SimServer
from tests.observability import isolated, start_node

from .sched_harness import Bench, bench

SLACK = 600.0  # the queue's group_slack_s


def chat(system: str | None, i: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"question {i}"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system * MIN_CHARS})
    return {"messages": messages, "max_tokens": 4}


def submit(b: Bench, items: list[tuple[str | None, int, float]], queue: str = "g") -> list[str]:
    """Items (system prompt letter or None, priority, deadline): their ids, in order."""
    reqs = b.pl.submit_many(
        [
            {"payload": chat(s, i), "queue": queue, "priority": p, "deadline": d}
            for i, (s, p, d) in enumerate(items)
        ]
    )
    return [r.id for r in reqs]


def drain(b: Bench, sizes: list[int], queue: str = "g") -> list[str]:
    """Dispatch everything in ticks of the given sizes (cycled): the ids in dispatch order."""
    order: list[str] = []
    i = 0
    while True:
        res = b.tick({queue: {}}, sizes[i % len(sizes)])
        if not res.moved:
            return order
        order += [d.id for d in res.moved]
        i += 1


def expected(ids: list[str], items: list[tuple[str | None, int, float]]) -> list[str]:
    """The pending set's order: priority (higher first), deadline (ms), submission."""
    keyed = sorted(range(len(ids)), key=lambda i: (-items[i][1], round(items[i][2] * 1000), i))
    return [ids[i] for i in keyed]


QUEUE = {"queue_name": "g", "group_slack_s": SLACK}

items_st = st.lists(
    st.tuples(
        st.sampled_from(["A", "B", "C", None]), st.sampled_from([0, 0, 5]), st.integers(0, 50)
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=items_st, sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_with_no_slack_the_order_is_exactly_todays(
    redis_url: str, items: list[tuple[str | None, int, int]], sizes: list[int]
) -> None:
    """Deadlines all nearer than the slack: whatever the prefixes, the pending set's order
    (a prefix sent first, so that the queue has one to group by)."""
    now = time.time()
    with bench(redis_url, [QUEUE]) as b:
        first = submit(b, [("A", 9, now + 100)])
        assert drain(b, [1]) == first
        rows = [(s, p, now + 10 + d) for s, p, d in items]
        ids = submit(b, rows)
        assert drain(b, sizes) == expected(ids, rows)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=items_st, near=st.sets(st.integers(0, 29)))
def test_grouping_never_crosses_a_priority_nor_passes_a_head_without_slack(
    redis_url: str, items: list[tuple[str | None, int, int]], near: set[int]
) -> None:
    """Some deadlines far (grouping may reorder), some near: a request is only ever sent
    after one that the pending set orders after it when both have the same priority and it
    had at least the slack left when passed over."""
    now = time.time()
    rows = [(s, p, now + (10 if i in near else 2 * SLACK) + d) for i, (s, p, d) in enumerate(items)]
    with bench(redis_url, [QUEUE]) as b:
        ids = submit(b, rows)
        t0 = time.time()
        order = drain(b, [1, 3])
    assert sorted(order) == sorted(ids)
    rank = {rid: i for i, rid in enumerate(expected(ids, rows))}
    row = dict(zip(ids, rows, strict=True))
    for i, early in enumerate(order):
        for late in order[i + 1 :]:
            if rank[late] < rank[early]:  # `late` was passed over by `early`
                assert row[late][1] == row[early][1], "grouping crossed a priority"
                assert row[late][2] - t0 >= SLACK - 1, "passed over without its slack"


def test_a_shared_prefix_goes_out_together(redis_url: str) -> None:
    """Interleaved system prompts with far deadlines leave in runs of one prompt, each run
    started by the head of the queue; a higher priority still goes first (and its prompt
    then leads); the decision logs
    say who went early and who was passed over; no prefix queue is left behind."""
    now = time.time()
    rows: list[tuple[str | None, int, float]] = [
        (s, 0, now + 3600 + i) for i, s in enumerate("ABCABCABC")
    ]
    rows.append(("C", 5, now + 4000))
    with bench(redis_url, [QUEUE]) as b:
        ids = submit(b, rows)
        order = drain(b, [1, 2])
        letters = [rows[ids.index(r)][0] for r in order]
        # the priority-5 C first; then the other Cs go early, ahead of the head (an A)
        assert letters == list("CCCCAAABBB") and order[0] == ids[-1]
        assert order[1:4] == [ids[2], ids[5], ids[8]]
        early = [describe_entry(e) for e in b.pl.explain(ids[2]).log]
        assert any(f"early for its prompt prefix (ahead of {ids[0]})" in x for x in early), early
        passed = [describe_entry(e) for e in b.pl.explain(ids[0]).log]
        assert sum("passed over" in x for x in passed) == 1, passed  # once, not per pass
        prefixed = list(b.client.scan_iter(b.store.keys.prefix_queue("g", "*")))
        assert prefixed == []


def test_a_queue_that_opts_out_keeps_the_pending_order(redis_url: str) -> None:
    now = time.time()
    rows: list[tuple[str | None, int, float]] = [
        (s, 0, now + 3600 + i) for i, s in enumerate("ABAB")
    ]
    with bench(redis_url, [{**QUEUE, "group_prefixes": False}]) as b:
        ids = submit(b, rows)
        assert drain(b, [1]) == ids
        assert b.client.hget(b.store.keys.request(ids[0]), "pfx") is None


def test_the_prefix_key() -> None:
    """A hash of the named field, else of the first system message, else of the prompt's
    start (a chat request's first message); none for a short start or a queue that opts out."""
    q = QueueConfig("q", "http://x")
    long = "x" * MIN_CHARS
    system = {"messages": [{"role": "system", "content": long}, {"role": "user", "content": "a"}]}
    other = {"messages": [{"role": "system", "content": long}, {"role": "user", "content": "b"}]}
    assert prefix_key(system, q) == prefix_key(other, q) != ""
    start = "x" * PREFIX_CHARS  # only the prompt's first PREFIX_CHARS count
    assert prefix_key({"prompt": start + "a"}, q) == prefix_key({"prompt": start + "b"}, q)
    assert prefix_key({"prompt": long + "a"}, q) != prefix_key({"prompt": long + "b"}, q)
    assert prefix_key({"prompt": "short"}, q) == "" == prefix_key([1, 2], q)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": long}]}]}
    assert prefix_key(parts, q) == prefix_key({"messages": [{"role": "user", "content": long}]}, q)
    named = QueueConfig("q", "http://x", prefix_field="doc")
    assert prefix_key({"doc": "d1", "prompt": "x"}, named) == prefix_key({"doc": "d1"}, named)
    assert prefix_key({"doc": "d1"}, named) != prefix_key({"doc": "d2"}, named)
    assert prefix_key(system, QueueConfig("q", "http://x", group_prefixes=False)) == ""


def test_engine_hints_send_the_time_left_and_the_prefix_key(
    env: dict[str, str], tmp_path: Path, sim: SimServer, start_worker: Any
) -> None:
    """A queue with ``engine_hints`` sends the time left to the deadline (ms) and the prefix
    key as headers; one without sends neither; the request's own header of that name is
    replaced, not doubled."""
    base = {"igw_base_url": sim.url, "request_path_url": "/v1/chat/completions"}
    iso = isolated(env, tmp_path, [{"queue_name": "hints", "engine_hints": True, **base},
                                   {"queue_name": "plain", **base}])  # fmt: skip
    node = start_node(start_worker, iso, concurrency=2)[0]
    body = chat("A", 1)
    tag = f"hints-{iso.queue('hints')}"
    try:
        hinted = iso.pl.submit(
            body,
            queue=iso.queue("hints"),
            timeout=60,
            headers={"X-Prefix-Key": "mine", "x-sim-record-headers": tag},
        )
        plain = iso.pl.submit(body, queue=iso.queue("plain"), timeout=60,
                              headers={"x-sim-record-headers": tag})  # fmt: skip
        assert iso.pl.wait(hinted.id, 30).ok and iso.pl.wait(plain.id, 30).ok
    finally:
        node.stop()
    calls = {dict(h)["x-request-id"]: h for h in sim.received_headers(tag)}
    hint = calls[hinted.id]
    assert [v for k, v in hint if k == "x-prefix-key"] == [prefix_key(body, QueueConfig("q", "x"))]
    (left,) = [int(v) for k, v in hint if k == "x-slo-ttft-ms"]
    assert 0 < left <= 60_000
    names = {k for k, _ in calls[plain.id]}
    assert "x-prefix-key" not in names and "x-slo-ttft-ms" not in names
