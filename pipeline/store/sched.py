"""Scheduling data for a pool's dispatch tick (``lua/dispatch.lua``) and the set-up of indexed
queues (``lua/sched.lua``: tenant sub-queues for fair share and quota-aware dispatch; see
docs/scheduling.md). A queue is indexed while its ``Keys.sched`` hash exists: its dispatchers
write it at start (:func:`setup`), and every script that adds or removes a waiting request
keeps the sub-queues in step from then on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from .keys import Keys
from .scripts import Scripts, node_client

CHUNK = 500


@dataclass(frozen=True)
class QuotaSpec:
    """A blocking, per-key concurrency quota in a queue's gates (``redis-quota`` with
    ``mode: concurrency``): the dispatch script counts each key's dispatched and running
    requests against ``limit`` (and ``lookahead`` attempts past it, which park at the worker
    for a release of the key). A request's key is ``key_prefix + metadata[attribute]``
    (``<prefix><attribute>:<value>``, the reference's quota key); ``local`` when the key's
    leases live in the pipeline's Redis (then they count too)."""

    key_prefix: str
    attribute: str
    limit: int
    lookahead: int = 0
    local: bool = True

    def arg(self) -> dict[str, Any]:
        return {
            "k": self.key_prefix,
            "attr": self.attribute,
            "limit": self.limit,
            "la": self.lookahead,
            "h": self.local,
        }


@dataclass(frozen=True)
class TokenSpec:
    """A blocking token budget in a queue's gates (``redis-quota`` with ``mode: tokens``,
    whose window lives in the pipeline's Redis): the dispatch script holds a tenant back while
    its head request's estimate does not fit in the window of its key (``limit`` tokens per
    ``window_s``), and charges the estimate of each attempt it sends (``d<n>``, taken over
    by the attempt's own admission: lua/gate_tokens_acquire.lua). A request's window is
    ``log`` / ``charges`` + ``metadata[attribute]`` under the gate prefix
    (:func:`~.keys.gate_tokens_roots`); ``default_max_tokens`` as the gate's."""

    log: str
    charges: str
    attribute: str
    limit: int
    window_s: float
    default_max_tokens: int

    def arg(self) -> dict[str, Any]:
        return {
            "log": self.log,
            "ch": self.charges,
            "attr": self.attribute,
            "limit": self.limit,
            "window": self.window_s,
            "dmt": self.default_max_tokens,
        }


@dataclass(frozen=True)
class QueueTick:
    """One queue in a pool's dispatch tick. ``dispatch`` False: only its active requests count
    against the pool's slots (and it is swept when ``sweep``)."""

    name: str
    budget: float = 0.0  # the gate's dispatch budget, 0..1
    cap: int = -1  # most dispatched + running requests of the queue (-1: no limit)
    # dispatched + running below which a tenant is sent past its quota key (-1: cap)
    ahead_cap: int = -1
    dispatch: bool = True
    sweep: bool = True
    weight: float = 1.0
    lane: int = 0
    specs: tuple[QuotaSpec, ...] = ()
    tokens: tuple[TokenSpec, ...] = ()
    rand: float = 0.0  # where a new round-robin counter of the queue starts (0..1)
    result_list: tuple[str, str, str] = ("", "0", "0")  # key, max length, TTL
    group_slack_s: float | None = None  # prefix grouping (None: off), dispatch.lua's gs

    def arg(self) -> dict[str, Any]:
        tokens = {"tokens": [t.arg() for t in self.tokens]} if self.tokens else {}
        return {
            "name": self.name,
            "dispatch": self.dispatch,
            "sweep": self.sweep,
            "budget": max(0.0, min(1.0, self.budget)),
            "cap": self.cap,
            "acap": self.ahead_cap,
            "weight": self.weight,
            "lane": self.lane,
            "rand": round(self.rand, 6),  # (17 digits make the script's JSON decode slower)
            "rl": bool(self.result_list[0]),  # else its results key in KEYS only holds the place
            "rl_max": self.result_list[1],
            "rl_ttl": self.result_list[2],
            "specs": [s.arg() for s in self.specs],
            **tokens,
            **({"gs": self.group_slack_s} if self.group_slack_s is not None else {}),
        }


@dataclass(frozen=True)
class MergeArgs:
    """The pool's merge policy as the dispatch script takes it."""

    policy: str = "random-robin"
    max_wait: int = 15
    lookahead: int = 0  # most quota look-ahead attempts per tick


def setup(
    client: redis.Redis,
    scripts: Scripts,
    keys: Keys,
    queue: str,
    pool: str,
    attribute: str,
    fair: bool,
) -> int:
    """Index ``queue`` (tenants = values of metadata ``attribute``; ``fair``: fair share) and
    the requests already waiting in it; returns how many were indexed now. Idempotent; a
    queue indexed with another attribute is re-indexed from scratch."""
    conf = keys.sched(queue)
    current = client.hmget(conf, "attr", "fair")  # the client decodes replies (Store's does)
    attr = attribute.removeprefix("metadata.")
    flag = "1" if fair else "0"
    if current[0] is not None and current != [attr, flag]:
        teardown(client, keys, queue)
    client.hset(conf, mapping={"attr": attr, "fair": flag, "pool": pool})
    done = 0
    while True:
        res = scripts.sched_index(keys=[keys.pending(queue), *keys.families], args=[queue, CHUNK])
        done += int(res[1])
        if int(res[0]) == 0:
            return done


def teardown(client: redis.Redis, keys: Keys, queue: str) -> None:
    """Stop indexing ``queue``: its sched hash, ready set, blocked tenants (and when they
    wake) and sub-queues go (pending keeps every waiting request; dispatch goes back to the
    pending order)."""
    blocked: dict[str, str] = client.hgetall(keys.blocked(queue))  # type: ignore[assignment]
    # at the queue's server (on a cluster its pool's primary, which takes a multi-key DEL)
    with node_client(client, keys.sched(queue)).pipeline(transaction=False) as pipe:
        pipe.delete(keys.sched(queue), keys.ready(queue), keys.blocked(queue), keys.wakeups(queue))
        for tk, qk in blocked.items():
            pipe.srem(keys.quota_blocked(qk), f"{queue}\n{tk}")
        pipe.execute()
    for key in client.scan_iter(keys.tenant_queue(queue, "*"), count=1000):
        client.delete(key)


def indexed(client: redis.Redis, keys: Keys, queue: str) -> bool:
    return bool(client.exists(keys.sched(queue)))


def recheck(scripts: Scripts, keys: Keys, queue: str) -> int:
    """Make every tenant of ``queue`` that is held back by a quota key ready again (the next
    tick holds back those still at their limit): a safety net against a wake-up that was lost
    (a lease freed by a reaper, a limit raised); returns how many."""
    return int(scripts.sched_recheck(keys=keys.families, args=[queue]))
