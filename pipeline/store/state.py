"""Redis operations on request state. Each one is a single atomic script or command.

Used by the client API (submit, cancel, inspect), the dispatcher (dispatch ticks, reaping)
and the Celery task (start, finish, requeue, renew). Times are Unix seconds by the Redis
server's clock: the scripts read it (``TIME``), and callers pass durations (a lease, a retry
delay), never a time of their own clock — node clocks may disagree by minutes.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import redis
from redis.exceptions import NoScriptError, OutOfMemoryError

from ..config import QueueConfig, Settings
from ..errors import StoreFull
from . import bodies, wire
from .connect import connect
from .journal import Journal, entry
from .keys import Keys, pool_keys
from .rows import RequestRow
from .sched import MergeArgs, QueueTick, QuotaSpec
from .scripts import ScriptCall, Scripts, ThreadConnection, node_client

SWEEP_LIMIT = 500
SUBMIT_FIRST_CHUNK = 32  # rows in the first submit.lua call of a batch; each next one doubles
SUBMIT_MAX_CHUNK = 500  # ... up to this many
EXPLAIN_LISTED = 20  # holders and requests an explain lists per quota key
INGEST_BATCH = 100  # entries of a reference producer's sorted set one ingest call looks at


def ordering_score(priority: int, deadline: float) -> float:
    """The pending-set score submit.lua gives a request: higher priority first, then earliest
    deadline (ms precision). Submission order breaks ties (the member starts with a sequence
    number)."""
    return (9 - priority) * 1e13 + math.floor(deadline * 1000.0 + 0.5)


def new_token() -> str:
    return secrets.token_hex(6)


@dataclass(frozen=True)
class Mirror:
    """A copy of an attempt's outcome written by the same script call as the outcome itself
    (the Celery result of the attempt's task: see ``tasks.backend``, which then skips its own
    round trip): ``head``, the result JSON when ``embed``, then ``tail``, stored at ``key``
    for ``ttl`` s (0: no expiry) and published on that key's channel. ``state`` names it."""

    key: str
    state: str
    head: str
    tail: str = ""
    embed: bool = False
    ttl: int = 0


@dataclass(frozen=True)
class Dispatched:
    """A request the dispatcher moved out of its queue: send it to Celery now."""

    id: str
    token: str
    dispatch_no: int
    priority: int
    queue: str
    # an indexed queue's request: its tenant, {attribute: value} (the worker sends its quota
    # acquire in the round trip of its start); None when the dispatcher had none to give
    tenant: dict[str, str] | None = None


@dataclass(frozen=True)
class DirectPublish:
    """Where a dispatch tick pushes its Celery messages itself, when the Celery broker is the
    pipeline's own Redis: the Redis list of the pool's Celery queue (kombu's Redis transport
    keeps a queue's messages in a list named after it), the task name and the origin header."""

    list_key: str
    task: str
    origin: str


@dataclass(frozen=True)
class Started:
    """A started attempt: its request ``record`` (the fields an attempt reads: see
    ``start.lua``), and the seconds to add to this machine's ``time.time()`` to read the Redis
    server's clock (``clock_offset``, taken as it started): the attempt measures its deadline by
    the server's clock, never by this machine's alone."""

    record: dict[str, str]
    clock_offset: float


@dataclass(frozen=True)
class TickResult:
    """What a dispatch tick did, per queue by name (a queue without rejected members is not
    in ``rejected``)."""

    moved: list[Dispatched]
    expired: dict[str, int]
    next_event: float | None  # s from now: the earliest due retry or waiting deadline
    rejected: dict[str, list[str]] = field(default_factory=dict)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _resulted(reply: Any) -> bool:
    """Did a dispatch tick (``dispatch.lua``'s reply) write terminal results: requests it
    expired, or malformed entries it removed? Only then does it wait for replicas (a lost
    dispatch comes back with its lease; docs/production.md, "Waiting for replicas")."""
    _, expired, _, rejected = reply
    return any(int(n) for n in expired) or any(bool(r) for r in rejected)


def _priority(raw: Any) -> int:
    """A moved request's priority as the tick read it (dispatch.lua ends a record whose
    priority is not an integer); 0 for anything else, never a failed tick: one request's field
    must not lose the other requests the tick moved."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


def _sent(make: Callable[_P, ScriptCall], read: Callable[[Any], _R]) -> Callable[_P, _R]:
    """A method that sends the call ``make`` builds, now, and returns ``read(reply)``."""

    def now(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return read(make(*args, **kwargs)())

    return now


class Store:
    """Request state in Redis for one :class:`Settings`."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis | None = None,
        *,
        pool: str | None = None,
        shared: Store | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.cluster = settings.redis_cluster
        self.keys = (
            Keys(settings.key_prefix) if pool is None else pool_keys(settings.key_prefix, pool)
        )
        self.client = client or connect(
            settings.redis_url,
            sentinel_master=settings.redis_sentinel_master,
            connections=settings.redis_connections,
        )
        self.scripts: Scripts = (
            shared.scripts
            if shared
            else Scripts(self.client, settings.redis_min_replicas, settings.redis_wait_timeout_ms)
        )
        self._pools: dict[str, Store] = shared._pools if shared else {}

    def for_pool(self, pool: str) -> Store:
        """The store of ``pool``'s keys: this one on a standalone Redis; on a Redis Cluster,
        one whose keys all carry the pool's hash tag (docs/production.md, "Redis Cluster")."""
        if not self.cluster or pool == self.pool:
            return self
        store = self._pools.get(pool)
        if store is None:
            store = self._pools[pool] = Store(self.settings, self.client, pool=pool, shared=self)
        return store

    def every_pool(self, pools: Iterable[str]) -> list[Store]:
        """Where a request of any of ``pools`` may be: this store, or each pool's on a cluster."""
        return [self.for_pool(p) for p in pools] if self.cluster else [self]

    def holding(self, key: Callable[[Keys], str], queues: Iterable[QueueConfig]) -> Store | None:
        """The store whose ``key`` (of its keys) exists: this one on a standalone Redis; on a
        cluster, the pool of ``queues`` whose slot has it (each asked, in one round trip), or
        None when none does."""
        stores = self.every_pool(dict.fromkeys(q.worker_pool_id for q in queues))
        if len(stores) <= 1:
            return stores[0] if stores else self
        with self.client.pipeline(transaction=False) as p:
            for store in stores:
                p.exists(key(store.keys))
            found = p.execute()
        return next((s for s, n in zip(stores, found, strict=True) if n), None)

    def find(self, request_id: str, queues: Iterable[QueueConfig]) -> Store:
        """The store holding the request's record (:meth:`holding`), else the first pool's
        (the request is unknown there too)."""
        if not self.cluster:
            return self
        queues = list(queues)
        pools = list(dict.fromkeys(q.worker_pool_id for q in queues))
        found = self.holding(lambda k: k.request(request_id), queues)
        return found or (self.for_pool(pools[0]) if pools else self)

    def result_list_args(self, queue: QueueConfig) -> tuple[str, str, str]:
        """(list key or '' for none, max length, TTL in s) of a queue's result list, as the
        scripts take them (request records carry them: see lib.lua's push_result)."""
        if not queue.result_list:
            return "", "0", "0"
        ttl = queue.result_ttl_seconds or self.settings.result_ttl_s
        return self.keys.result_list(queue), str(queue.result_list_max_len), str(int(ttl))

    def submit(self, rows: Sequence[RequestRow]) -> list[Any]:
        """Store a batch of rows (:class:`RequestRow`) in growing chunks, one round trip each
        (docs/internals.md, "submit_many in growing chunks"). Returns 1 per created request,
        or the state of the live duplicate. A chunk is all or nothing: a Redis at its
        ``maxmemory`` refuses the script's first write (submit.lua writes nothing before it),
        and :class:`~pipeline.errors.StoreFull` names the ids of the chunks stored before."""
        out: list[Any] = []
        i, size = 0, SUBMIT_FIRST_CHUNK
        while i < len(rows):
            items = json.dumps(rows[i : i + size], ensure_ascii=False, separators=(",", ":"))
            try:
                out.extend(self.scripts.submit(keys=self.keys.families, args=[items]))
            except OutOfMemoryError:
                raise StoreFull(
                    "submit", [r.id for r in rows[:i]], [r.id for r in rows[i:]]
                ) from None
            i, size = i + size, min(SUBMIT_MAX_CHUNK, size * 2)
        return out

    # -- reference producers (a queue with "ingest": "llm-d-async") ---------------------
    def ingest(self, queue: QueueConfig) -> dict[str, list[str]]:
        """Move what a producer of the llm-d-async reference wrote into ``queue``'s sorted set
        (its name, verbatim) into the queue: up to :data:`INGEST_BATCH` entries, in the set's
        order, through ``ingest.lua`` (atomic; each entry at most once, whichever node takes
        it). Returns the ids by outcome (``ingested``, ``invalid``, ``cancelled``, ...)."""
        members = [str(m) for m in self.client.zrange(queue.queue_name, 0, INGEST_BATCH - 1)]
        if not members:
            return {}
        entries: list[list[str]] = []
        for member in members:
            env = wire.parse(member, self.settings.max_payload_bytes)
            if isinstance(env, wire.Malformed):
                routed = wire.result_list(queue.result_queue_name, env.result_list)
                entries.append([member, "bad", env.id, routed, env.message, env.token])
                continue
            entries.append([
                member, "ok", env.id, env.token, repr(ordering_score(0, env.deadline)),
                repr(env.deadline), env.payload, env.payload_ref,
                json.dumps(env.metadata), json.dumps(env.headers), env.endpoint,
                wire.result_list(queue.result_queue_name, env.result_list),
            ])  # fmt: skip
        k = self.keys
        words = self.scripts.ingest(
            keys=[
                queue.queue_name,
                k.pending(queue.queue_name),
                k.expiry(queue.queue_name),
                k.wake(queue.worker_pool_id),
                *k.families,
            ],
            args=[
                queue.queue_name,
                queue.worker_pool_id,
                json.dumps(queue.labels) if queue.labels else "{}",
                json.dumps(entries, ensure_ascii=False),
                str(queue.result_list_max_len),
                str(int(queue.result_ttl_seconds or self.settings.result_ttl_s)),
            ],
        )
        out: dict[str, list[str]] = {}
        for row, word in zip(entries, words, strict=True):
            out.setdefault(str(word), []).append(row[2])
        return out

    # -- dispatcher ----------------------------------------------------------------------
    def tick_pool(
        self,
        pool: str,
        queues: list[QueueTick],
        pool_cap: int,
        *,
        merge: MergeArgs | None = None,
        publish: DirectPublish | None = None,
        doorbell: str | None = None,
        block: float | None = None,
    ) -> TickResult:
        """One dispatch tick of a worker pool (``dispatch.lua``, one atomic step): sweep each
        queue, then dispatch while the pool has a free slot, the merge policy choosing among
        the queues. ``publish``: the script also pushes the Celery messages; ``doorbell``: it
        first empties that list; ``block`` (s, with ``doorbell``): the tick waits for a ring
        (``BLPOP``) sent in the same write (docs/internals.md, "Wait and tick in one round
        trip")."""
        k = self.keys
        merge = merge or MergeArgs()
        publish = publish or DirectPublish("", "", "")  # none: the script pushes no message
        keys: list[str] = []
        # a key of the pool's slot holds the place of a list there is none of (on a Redis
        # Cluster every key of a call must be in one slot, and '' is in slot 0)
        for q in queues:
            keys += [k.pending(q.name), k.delayed(q.name), k.expiry(q.name), k.active(q.name)]
            keys.append(q.result_list[0] or k.pending(q.name))
        keys += [k.merge(pool), publish.list_key or k.merge(pool)]
        if doorbell:
            keys.append(doorbell)
        keys += k.families
        cfg = {
            "cap": pool_cap,
            "lease": self.settings.dispatch_lease_s,
            "ttl": int(self.settings.result_ttl_s),
            "sweep": SWEEP_LIMIT,
            "nonce": new_token(),
            "task": publish.task,
            "origin": publish.origin,
            "doorbell": bool(doorbell),
            "policy": merge.policy,
            "max_wait": merge.max_wait,
            "lookahead": merge.lookahead,
            "queues": [q.arg() for q in queues],
        }
        args = [json.dumps(cfg, separators=(",", ":"))]
        moved_raw, expired, next_event, rejected = self._dispatch(keys, args, doorbell, block)
        moved = [
            Dispatched(
                moved_raw[i],
                moved_raw[i + 1],
                int(moved_raw[i + 2]),
                _priority(moved_raw[i + 3]),
                queues[int(moved_raw[i + 4]) - 1].name,
                json.loads(moved_raw[i + 5]) if moved_raw[i + 5] else None,
            )
            for i in range(0, len(moved_raw), 6)
        ]
        ne = float(next_event)
        return TickResult(
            moved,
            {q.name: int(n) for q, n in zip(queues, expired, strict=True)},
            ne if ne >= 0 else None,
            {q.name: list(r) for q, r in zip(queues, rejected, strict=True) if r},
        )

    def _dispatch(
        self, keys: list[str], args: list[Any], doorbell: str | None, block: float | None
    ) -> Any:
        script = self.scripts.dispatch
        if doorbell and block and block > 0 and script.replication is None:
            wait = ("BLPOP", doorbell, f"{max(block, 0.001):.3f}")
            lane = ThreadConnection.of(node_client(self.client, doorbell))
            replies = lane.execute([wait, script.command(keys, args)])
            if replies is not None and not isinstance(replies[1], NoScriptError):
                if isinstance(replies[1], Exception):
                    raise replies[1]
                return replies[1]
            # the connection failed or the server lost the script: the tick alone
        return script(keys=keys, args=args, wait_if=_resulted)

    def queue_tick(self, queue: QueueConfig, **kw: object) -> QueueTick:
        return QueueTick(
            queue.queue_name,
            weight=queue.weight,
            result_list=self.result_list_args(queue),
            **kw,  # type: ignore[arg-type]
        )

    def tick(
        self,
        queue: QueueConfig,
        pool_queues: list[QueueConfig],
        budget: float,
        queue_cap: int,
        pool_cap: int,
        publish: DirectPublish | None = None,
        doorbell: str | None = None,
    ) -> TickResult:
        """A tick of one queue alone (the pool's other queues only count against its slots):
        promote due retries, expire overdue waiting requests and dispatch
        ``floor(budget × free capacity)``. ``queue_cap`` -1: no limit. No quota accounting
        (the dispatcher's :meth:`tick_pool` does that)."""
        entries = [self.queue_tick(queue, budget=budget, cap=queue_cap)]
        entries += [
            self.queue_tick(q, dispatch=False, sweep=False)
            for q in pool_queues
            if q.queue_name != queue.queue_name
        ]
        return self.tick_pool(
            queue.worker_pool_id, entries, pool_cap, publish=publish, doorbell=doorbell
        )

    def node_beat_call(self, node: str, slots: int, pools: list[str], ttl_s: float) -> ScriptCall:
        """Register ``node`` (offering ``slots``) as live for ``ttl_s`` in each pool's registry
        and drop nodes that stopped beating, as a call to send in a batch;
        :meth:`node_beats` reads its reply."""
        keys = [k for p in pools for k in (self.keys.pool_nodes(p), self.keys.pool_slots(p))]
        return ScriptCall(self.scripts.node_beat, keys, [node, slots, repr(float(ttl_s))])

    @staticmethod
    def node_beats(reply: Any) -> list[tuple[int, int]]:
        """Per pool: (slots of its live nodes, live nodes)."""
        return [(int(total), int(live)) for total, live in reply]

    def reap(self, queue: str) -> list[tuple[str, str]]:
        """Requeue attempts of ``queue`` whose lease expired; returns (id, token) pairs."""
        raw = self.scripts.reap(keys=[self.keys.active(queue), *self.keys.families], args=[1000])
        return [(raw[i], raw[i + 1]) for i in range(0, len(raw), 2)]

    # -- attempts ------------------------------------------------------------------------
    def start_call(self, request_id: str, token: str, queue: str, worker: str) -> ScriptCall:
        """Begin an attempt, as a call to send in a batch; :meth:`started` reads its reply."""
        return ScriptCall(
            self.scripts.start,
            [self.keys.request(request_id), self.keys.active(queue)],
            [token, self.settings.lease_s, worker],
        )

    @staticmethod
    def started(reply: Any) -> Started | None:
        """The started attempt, None when the message is stale (fenced off by its token)."""
        if int(reply[0]) != 1:
            return None
        it = iter(reply[2:])
        return Started(dict(zip(it, it, strict=True)), float(reply[1]) - time.time())

    def finish_call(
        self,
        request_id: str,
        token: str,
        *,
        attempted: bool,
        status_code: int | None,
        payload: str,
        error_code: str | None = None,
        error_message: str | None = None,
        mirror: Mirror | None = None,
        handed_over: bool = False,
        nowake: bool = False,
        journal: Journal | None = None,
        body_key: str | None = None,
    ) -> ScriptCall:
        """The terminal result of an attempt (and its ``mirror``), as a call to send in a
        batch; :meth:`finished` reads its reply. ``handed_over``: its slot went to another
        attempt, so no release is published; ``nowake`` (with it): nor is the pool's doorbell
        rung (the taker still has attempts of the queue parked). ``journal``: the attempt's
        events for the decision log (taken now); the script adds the ``done`` entry.
        ``body_key``: where :meth:`put_body` stored the payload (``payload`` is then not
        sent): the result names it in ``payload_ref``."""
        keys = [self.keys.request(request_id)]
        if body_key is not None:
            keys.append(body_key)
            payload = ""
        extra: list[Any] = []
        if mirror is not None:
            keys.append(mirror.key)
            extra = [mirror.head, mirror.tail, mirror.ttl, 1 if mirror.embed else 0]
        return ScriptCall(
            self.scripts.finish,
            [*keys, *self.keys.families],
            [
                token,
                int(self.settings.result_ttl_s),
                1 if attempted else 0,
                "" if status_code is None else status_code,
                payload,
                error_code or "",
                error_message or "",
                (2 if nowake else 1) if handed_over else 0,
                journal.take() if journal is not None else "",
                1 if body_key is not None else 0,
                *extra,
            ],
        )

    def put_body(self, request_id: str, token: str, payload: str) -> str:
        """Store an attempt's answer body once, before its finish (one plain ``SET`` with the
        result's expiry: the body never passes through a script, which would copy and escape
        it); returns its key for :meth:`finish_call`, which re-arms that expiry with the
        result's. A finish fenced off deletes it."""
        key = self.keys.body(request_id, token)
        self.client.set(key, payload, ex=max(1, int(self.settings.result_ttl_s)))
        return key

    def with_body(self, data: dict[str, Any]) -> dict[str, Any]:
        """A stored result (parsed) with its body, read back when stored apart
        (:func:`.bodies.with_body`; UnknownRequest when it is gone)."""
        return bodies.with_body(data, self.client)

    @staticmethod
    def finished(reply: Any) -> str | None:
        """The result JSON a finish call wrote, None when it was fenced off."""
        return reply or None

    def requeue_call(
        self,
        request_id: str,
        token: str,
        *,
        delay: float,
        attempted: bool,
        last_response: dict[str, Any] | None = None,
        last_error: str | None = None,
        mirror: Mirror | None = None,
        handed_over: bool = False,
        journal: Journal | None = None,
        note: dict[str, Any] | None = None,
    ) -> ScriptCall:
        """Give the request back to its queue, now or ``delay`` s from now by the server's
        clock, and write its ``mirror`` (``head`` alone), as a call to send in a batch;
        :meth:`requeued` reads its reply. ``handed_over`` as in :meth:`finish_call`. The
        decision log gets the ``journal``'s events, then ``note`` (default
        ``{"e": "requeued"}``; see :func:`pipeline.store.journal.entry`) with the delay."""
        last = dict(note or entry("requeued"))
        if delay > 0:
            last["delay"] = round(float(delay), 3)
        text = (journal or Journal()).take(last)
        keys = [self.keys.request(request_id)]
        extra: list[Any] = []
        if mirror is not None:
            keys.append(mirror.key)
            extra = [mirror.head, mirror.ttl]
        return ScriptCall(
            self.scripts.requeue,
            [*keys, *self.keys.families],
            [
                token,
                repr(float(delay)),
                1 if attempted else 0,
                json.dumps(last_response) if last_response else "",
                (last_error or "")[:500],
                1 if handed_over else 0,
                text,
                *extra,
            ],
        )

    @staticmethod
    def requeued(reply: Any) -> float | None:
        """The due time a requeue call set (Unix s, server clock), None when fenced off."""
        return float(reply) if reply else None

    # each call sent now, alone, its reply read (typed as the ``*_call`` it sends)
    node_beat = _sent(node_beat_call, node_beats)
    start = _sent(start_call, started)
    finish = _sent(finish_call, finished)
    requeue = _sent(requeue_call, requeued)

    def current(self, request_id: str, token: str) -> bool:
        """Whether the attempt ``token`` is still its request's (the record holds its token;
        False when the record is gone)."""
        return bool(self.client.hget(self.keys.request(request_id), "token") == token)

    def note(self, request_id: str, token: str, journal: Journal) -> bool:
        """Send a running attempt's journaled events to its request's decision log now (one
        round trip; ``note.lua``, fenced by the token). False when fenced off."""
        text = journal.take()
        if not text:
            return False
        return bool(self.scripts.note(keys=[self.keys.request(request_id)], args=[token, text]))

    def explain(
        self, request_id: str, quotas: dict[str, list[QuotaSpec]] | None = None
    ) -> dict[str, Any] | None:
        """Where a request stands, read in one atomic step (``explain.lua``): its record
        (without payload, metadata or headers), the server's clock, its place in its queue,
        its retry due time or lease, the use of each of its quota keys (``quotas``: the
        blocking concurrency quotas of each queue, see :class:`QuotaSpec`; at most
        :data:`EXPLAIN_LISTED` holders and requests each) and its decision log. None for an
        unknown id."""
        specs = {q: [s.arg() for s in specs] for q, specs in (quotas or {}).items() if specs}
        raw = self.scripts.explain(
            keys=[self.keys.request(request_id), *self.keys.families],
            args=[request_id, json.dumps(specs), EXPLAIN_LISTED],
        )
        return json.loads(raw) if raw else None

    def renew(self, attempts: list[tuple[str, str, str]]) -> list[str]:
        """Extend the leases of live attempts given as (id, token, queue); returns the ids of
        those no longer current (fenced off: reaped, or cancelled with running 'abort')."""
        if not attempts:
            return []
        keys: list[str] = []
        args: list[Any] = [self.settings.lease_s]
        for request_id, token, queue in attempts:
            keys += [self.keys.request(request_id), self.keys.active(queue)]
            args += [request_id, token]
        return [str(rid) for rid in self.scripts.renew(keys=keys, args=args)]

    def note_span(self, request_id: str, token: str, traceparent: str) -> None:
        """Record the running attempt's trace span (``attempt_span`` = ``<token> <traceparent>``)
        so a reaper in another process can link its ``re-enqueue`` span to it. The record
        exists while the attempt runs (a finished one keeps its TTL)."""
        self.client.hset(self.keys.request(request_id), "attempt_span", f"{token} {traceparent}")

    def attempt_span(self, request_id: str, token: str) -> str | None:
        """The traceparent :meth:`note_span` left for this attempt (None for another one)."""
        raw = self.client.hget(self.keys.request(request_id), "attempt_span")
        noted_token, _, traceparent = str(raw or "").partition(" ")
        return traceparent if raw and noted_token == token else None

    # -- client side ---------------------------------------------------------------------
    def cancel(self, request_id: str, running: str = "finish", by: str = "") -> bool | None:
        """Cancel (cancel.lua): ``running`` 'finish' lets a sent attempt finish, 'abort' ends
        it now; ``by`` says who asked (the decision log). True when cancelled, None for an
        unknown request."""
        res = int(
            self.scripts.cancel(
                keys=[self.keys.request(request_id), *self.keys.families],
                args=[int(self.settings.result_ttl_s), running, by],
            )
        )
        return None if res < 0 else res == 1

    def cancel_asked(self, request_id: str, token: str) -> str | None:
        """Was the request (or its batch) cancelled while this attempt was parked at its
        worker? The reason (``cancelled``, ``batch cancelled``), else None (also when fenced
        off: its finish finds that out)."""
        res = self.scripts.cancel_asked(
            keys=[self.keys.request(request_id), *self.keys.families], args=[token]
        )
        return str(res) if res else None  # the client decodes replies (as record() relies on)

    def record(self, request_id: str) -> dict[str, str]:
        return self.client.hgetall(self.keys.request(request_id))  # type: ignore[return-value]
