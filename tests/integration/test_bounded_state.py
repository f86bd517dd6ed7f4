"""Redis state stays bounded: result lists are trimmed and expire, and every key a finished
request, a retry or a gate decision leaves behind either expires or is one of a fixed set of
per-queue / per-pool / per-gate structures that do not grow with the number of requests."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from tests.conftest import RESULTS_TAG, assert_idle, held


def finish(p: Pipeline, items: list[dict[str, Any]], timeout: float = 30.0) -> list[Any]:
    reqs = p.submit_many(items)
    return [r.result(timeout=timeout) for r in reqs]


def test_result_list_is_trimmed_to_its_max_len_and_expires(served: Pipeline) -> None:
    client = served.store.client
    key = served.store.keys.result_list(served.settings.queues["capped"])
    assert key == f"{RESULTS_TAG}-results-capped"
    client.delete(key)
    results = finish(served, [{"payload": {"i": i}, "queue": "capped"} for i in range(12)])
    assert all(r.ok for r in results)
    kept = [json.loads(x)["id"] for x in client.lrange(key, 0, -1)]
    assert len(kept) == 5  # result_list_max_len
    assert set(kept) <= {r.id for r in results}
    assert 0 < client.ttl(key) <= 60  # result_ttl_seconds, re-armed on every push
    client.delete(key)


def test_result_list_false_pushes_nothing(served: Pipeline) -> None:
    key = served.store.keys.default_result_list("nolist")
    results = finish(served, [{"payload": {"i": i}, "queue": "nolist"} for i in range(3)])
    assert all(r.ok for r in results)  # results are still read by id
    assert served.store.client.exists(key) == 0


def test_a_default_result_list_expires_with_the_result_ttl(served: Pipeline) -> None:
    key = served.store.keys.result_list(served.settings.queues["default"])
    (res,) = finish(served, [{"payload": {"x": 1}}])
    assert res.ok
    ttl = served.store.client.ttl(key)
    assert 0 < ttl <= served.settings.result_ttl_s  # the default: the result TTL
    assert served.store.client.llen(key) <= 100_000


def test_only_a_request_a_client_waits_for_gets_a_notify_list(served: Pipeline, sim: Any) -> None:
    """The result is pushed on a request's notify list only when a client waits for it
    (``Request.result`` marks the record first, in one step with reading it): a request read
    some other way leaves no notify key; a waiting client's request gets one, expiring."""
    client = served.store.client
    keys = served.store.keys
    unwaited = served.submit({"n": 1})
    (got,) = list(served.iter_results([unwaited.id]))  # polled: nobody waits on its list
    assert got.ok
    assert client.exists(keys.notify(unwaited.id)) == 0
    assert client.hget(keys.request(unwaited.id), "waiter") is None
    name = "notify-waited"
    waited = served.submit({"n": 2}, headers=held(name))
    sim.wait_held(name)
    box: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: box.setdefault("r", waited.result(timeout=30)))
    waiter.start()
    wait_until(
        lambda: client.hget(keys.request(waited.id), "waiter") == "1",
        10,
        'client.hget(keys.request(waited.id), "waiter") == "1"',
    )
    sim.release(name)
    waiter.join(30)
    assert box["r"].ok
    assert 0 < client.ttl(keys.notify(waited.id)) <= 300
    assert waited.result(timeout=1).ok  # done already: read at once, nothing marked again
    assert_idle(served)


# keys that may live without an expiry: one per queue, pool, gate or prefix, never one per
# request; each is bounded by construction (named in the comment)
BOUNDED = [
    r"seq",  # one counter
    r"epoch",  # one hash: the store's epoch, the alarm for a wiped Redis (a few fields)
    r"wedged",  # one field per wedged queue
    r"q:[^:]+:(pending|delayed|expiry|active)",  # waiting / running requests only
    r"q:[^:]+:stats",  # one counter per outcome
    r"q:[^:]+:recent",  # trimmed to the last 5 minutes by one finish in 16
    r"pool:[^:]+:(nodes|slots|wake)",  # live nodes (dead ones pruned), a doorbell
    r"gate:[^:]+:nodes",  # nodes whose slot pool exists (pruned by the reaper)
    r"pool:[^:]+:merge",  # the merge policy's state: one field per queue and lane
    r"q:[^:]+:sched",  # an indexed queue's settings and counters (a few fields)
    r"q:[^:]+:(ready|blocked)",  # one entry per tenant with waiting requests only
    r"q:[^:]+:wakeups",  # one entry per token budget key holding tenants back, until it is due
    r"q:[^:]+:t:.*",  # a tenant's waiting requests only (an empty sorted set is no key)
    r"gate:.+:(sent|blocked)",  # a quota key's active requests / tenants held back only
    # one entry per unexpired batch / file: pruned when its record expires (batch_create.lua,
    # Files.sweep); active batches only; a doorbell of at most one element
    r"batches(:expiry|:active|:bell)?",
    r"files(:expiry)?",
]


def test_every_key_a_finished_request_leaves_expires_or_is_bounded(
    served: Pipeline, sim: Any
) -> None:
    """Successes, a retried 503, a 400 and a cancel, through a gated queue too: afterwards
    every key under the prefix expires, or is one of the bounded structures above."""
    items: list[dict[str, Any]] = [{"payload": {"i": i}} for i in range(5)]
    retry = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
    items.append({"payload": {"r": 1}, "headers": retry})
    items.append({"payload": {"bad": 1}, "headers": {**retry, "x-sim-fail-status": "400"}})
    items += [{"payload": {"g": i}, "queue": "lim2"} for i in range(4)]
    results = finish(served, items)
    assert sum(r.ok for r in results) == len(items) - 1
    queued = served.submit({"c": 1}, queue="solo")  # no worker serves "solo": cancel it
    assert queued.cancel()
    client = served.store.client
    prefix = served.store.keys.prefix
    allowed = re.compile("^(" + "|".join(BOUNDED) + ")$")
    wait_until(
        lambda: all(q["running"] == 0 for q in served.inspect().values()),
        10,
        'all(q["running"] == 0 for q in served.inspect().values())',
    )
    unbounded = []
    for key in client.scan_iter(prefix + "*", count=10_000):
        rest = key[len(prefix) :]
        if client.ttl(key) == -1 and not allowed.match(rest):
            unbounded.append(rest)
    assert unbounded == []
    ttl = served.settings.result_ttl_s
    for rid in [*(r.id for r in results), queued.id]:  # and the per-request keys do expire
        assert 0 < client.ttl(served.store.keys.request(rid)) <= ttl
        # its decision log (explain) lives in the record, at most 50 entries, the last "done"
        log = client.hget(served.store.keys.request(rid), "log").split("\n")
        assert 1 <= len(log) <= 50 and json.loads(log[-1])["e"] == "done"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("result_list", "yes"),
        ("result_list_max_len", 0),
        ("result_list_max_len", 1.5),
        ("result_ttl_seconds", -1),
        ("result_ttl_seconds", True),
    ],
)
def test_bad_result_list_settings_name_the_field(field: str, value: Any) -> None:
    from pipeline.config import parse_queues
    from pipeline.errors import ConfigError

    entry = {"queue_name": "a", "igw_base_url": "http://x", field: value}
    with pytest.raises(ConfigError, match=field):
        parse_queues([entry], "queues.json")
