"""A pipeline on its own key prefix whose queues no worker serves, so a test drives the real
dispatch script (``Store.tick_pool``) by hand, and a consistency check of the scheduling
structures of an indexed queue (``pipeline/store/lua/sched.lua``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.client import Pipeline
from pipeline.config import MergePolicy, Settings, parse_queues
from pipeline.store import MergeArgs, QueueTick, QuotaSpec, sched


@dataclass
class Bench:
    """A pipeline on a fresh prefix; queues of pool ``p`` unless told otherwise."""

    pl: Pipeline

    @property
    def store(self) -> Any:
        return self.pl.store

    @property
    def client(self) -> redis.Redis:
        return self.pl.store.client  # type: ignore[no-any-return]

    def index(self, queue: str, fair: bool) -> None:
        q = self.pl.settings.queues[queue]
        sched.setup(
            self.client, self.store.scripts, self.store.keys, queue, q.worker_pool_id,
            "userid", fair,
        )  # fmt: skip

    def tick(
        self,
        queues: dict[str, dict[str, Any]],
        free: int,
        merge: MergeArgs | None = None,
        pool: str = "p",
    ) -> Any:
        """One dispatch tick of ``pool`` with ``free`` worker slots beyond its active
        requests; ``queues``: name → QueueTick fields (budget 1 unless given)."""
        entries: list[QueueTick] = []
        active = 0
        for name, kw in queues.items():
            q = self.pl.settings.queues[name]
            entries.append(self.store.queue_tick(q, **{"budget": 1.0, **kw}))
            active += int(self.client.zcard(self.store.keys.active(name)))
        return self.store.tick_pool(pool, entries, active + free, merge=merge)


@contextmanager
def bench(
    redis_url: str, queues: list[dict[str, Any]], merge: MergePolicy | None = None
) -> Iterator[Bench]:
    prefix = f"plsched{uuid.uuid4().hex[:8]}:"
    entries = [{"igw_base_url": "http://127.0.0.1:9", "worker_pool_id": "p", **q} for q in queues]
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        queues=parse_queues(entries, "test"),
        merge_policy=merge or MergePolicy(),
    )
    pl = Pipeline(settings)
    try:
        yield Bench(pl)
    finally:
        for key in pl.store.client.scan_iter(prefix + "*", count=10_000):
            pl.store.client.delete(key)


def quota_spec(limit: int, lookahead: int = 0) -> QuotaSpec:
    return QuotaSpec("quota:userid:", "userid", limit, lookahead)


def check_consistent(b: Bench, queue: str) -> None:
    """The scheduling structures of an indexed queue agree with its pending set: every waiting
    request is in exactly its tenant's sub-queue, each tenant with waiting requests is either
    ready (one ready entry: its head) or blocked (listed in its quota key's set), and the
    counter ``n`` is the number of waiting requests."""
    c, k = b.client, b.store.keys
    conf = c.hgetall(k.sched(queue))
    assert conf, f"{queue} is not indexed"
    pending = sorted(c.zrange(k.pending(queue), 0, -1, withscores=True))
    base = k.tenant_queue(queue, "")
    subs = {
        key[len(base) :]: c.zrange(key, 0, -1, withscores=True)
        for key in c.scan_iter(base + "*", count=10_000)
    }
    assert sorted(e for entries in subs.values() for e in entries) == pending
    assert int(conf.get("n", 0)) == len(pending)
    ready = c.zrange(k.ready(queue), 0, -1)
    blocked = c.hgetall(k.blocked(queue))
    assert len(ready) + len(blocked) == len(subs), (ready, blocked, list(subs))
    for tk, entries in subs.items():
        head = entries[0][0]
        if tk in blocked:
            assert f"{head}\n{tk}" not in ready
            assert c.sismember(k.quota_blocked(blocked[tk]), f"{queue}\n{tk}")
        else:
            assert f"{head}\n{tk}" in ready, (tk, head, ready)
