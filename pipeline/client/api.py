"""The client API: submit requests (checked here, the one boundary validator), read their
state and results, cancel, inspect."""

from __future__ import annotations

import getpass
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from ..config import QueueConfig, Settings, load_settings, with_overrides
from ..errors import (
    ConfigError,
    IdempotencyConflict,
    InvalidRequest,
    PipelineError,
    ReplicationError,
    StateLost,
    StoreFull,
    UnknownRequest,
)
from ..gates import Gate, GateEnv, attempt_gate, check_gates, queue_gate
from ..http.rules import (  # the HTTP client's own rules: what submit takes, it can send
    ATTEMPT_HEADERS,
    CONNECTION_HEADERS,
    MAX_ID_LENGTH,
    endpoint_error,
    headers_error,
    request_id_error,
)
from ..store import Epoch, Keys, QuotaSpec, RequestRow, Store
from ..store.wire import PAYLOAD_JSON
from .explain import Explanation, build
from .models import Result

FULL_RESCAN_S = 30.0  # iter_results re-reads every waiting id this often (recent keeps 300 s)
OUTAGE_S = 60.0  # wait and iter_results ride over a Redis unreachable this long (a restart)
MAX_DEADLINE_AHEAD_S = 10 * 365 * 24 * 3600.0
SUBMIT_KEYS = frozenset(
    {"queue", "id", "priority", "deadline", "timeout", "metadata", "headers", "endpoint"}
)


CANCEL_RUNNING = ("finish", "abort")  # what a cancel does to a running attempt
MAX_BY = 256


def canceller(by: str | None) -> str:
    """Who cancels, as the decision log names them: ``by``, else ``<user>@<host>``."""
    if by is None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no name for this uid (a bare container)
            user = f"uid {os.getuid()}"
        return f"{user}@{socket.gethostname()}"[:MAX_BY]
    if not isinstance(by, str) or len(by) > MAX_BY or not by.isprintable():
        raise InvalidRequest("by", f"must be printable text of at most {MAX_BY} characters")
    return by


def conflict(reply: Any) -> bool:
    """Whether submit.lua's reply for an item says its id is live with other content."""
    return isinstance(reply, str) and reply.startswith("conflict:")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _str_map(value: Any, field: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(field, "must be a dict of str to str")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidRequest(field, f"keys and values must be str (bad entry {k!r})")
    return dict(value)


def check_headers(value: Any, reserved: frozenset[str]) -> dict[str, str]:
    """A request's own headers: what the HTTP client can send (``pipeline.http.rules``),
    at most ``MAX_HEADERS_BYTES`` as sent, and none of the ``reserved`` names (lower case)
    whose value the pipeline sets."""
    headers = _str_map(value, "headers")
    wrong = headers_error(headers)
    if wrong is not None:
        raise InvalidRequest("headers", wrong)
    for name in headers:
        if name.lower() in reserved:
            raise InvalidRequest(
                "headers", f"{name!r} is set by the pipeline and cannot be given per request"
            )
    return headers


def _check_payload(payload: Any, max_bytes: int) -> tuple[str, int]:
    """The payload as compact UTF-8 JSON text and its size in bytes, or
    InvalidRequest("payload")."""
    if not isinstance(payload, dict):
        raise InvalidRequest("payload", "must be a dict (the JSON body to send)")
    try:
        body = PAYLOAD_JSON.encode(payload)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequest("payload", f"not JSON-serialisable: {exc}") from None
    try:
        size = len(body.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequest("payload", "contains text that is not valid UTF-8") from None
    if size > max_bytes:
        raise InvalidRequest("payload", f"larger than max_payload_bytes ({max_bytes})")
    return body, size


def _check_size(payload_size: int, metadata: str, headers: str, max_bytes: int) -> None:
    """Payload, metadata and headers together, as stored, within ``max_bytes``; the error
    names the one that takes them over."""
    size = payload_size + len(metadata)  # ASCII: json.dumps escapes the rest
    field = "metadata" if size > max_bytes else "headers"
    size += len(headers)
    if size > max_bytes:
        raise InvalidRequest(
            field,
            f"payload, metadata and headers together are {size} bytes as stored, over "
            f"max_payload_bytes ({max_bytes})",
        )


def _check_id(rid: Any) -> str:
    if rid is None:
        return uuid.uuid4().hex
    wrong = request_id_error(rid)
    if wrong is not None:
        raise InvalidRequest("id", wrong)
    return str(rid)


def check_lookup_id(rid: Any) -> str:
    """An id to look up (get, state, cancel, explain, ...): any id a record may have, written
    by submit or another producer; InvalidRequest("id") for one no record can have."""
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_LENGTH:
        raise InvalidRequest("id", f"must be a non-empty str of at most {MAX_ID_LENGTH} characters")
    return rid


def check_priority(priority: Any) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 9:
        raise InvalidRequest("priority", "must be an int from 0 to 9")
    return priority


def check_endpoint(endpoint: Any) -> str:
    """A request's own URL path ("" for its queue's ``request_path_url``), as the HTTP client
    will put it on the request line (``pipeline.http.rules.endpoint_error``)."""
    if endpoint is None:
        return ""
    wrong = endpoint_error(endpoint)
    if wrong is not None:
        raise InvalidRequest("endpoint", wrong)
    return str(endpoint)


def _check_deadline(deadline: Any, timeout: Any, default_timeout_s: float) -> tuple[str, str]:
    """``(deadline, timeout)`` for submit.lua: a timeout becomes a deadline by the Redis
    server's clock when stored (a client with a wrong clock still gets its time); "in the
    past" is a sanity check by this machine's clock."""
    if deadline is not None and timeout is not None:
        raise InvalidRequest("deadline", "give deadline or timeout, not both")
    if deadline is not None:
        now = time.time()
        if not _is_number(deadline):
            raise InvalidRequest("deadline", "must be a Unix time in seconds")
        if deadline <= now:
            raise InvalidRequest("deadline", "is in the past")
        if deadline > now + MAX_DEADLINE_AHEAD_S:
            raise InvalidRequest("deadline", "is more than 10 years ahead")
        return repr(float(deadline)), ""
    if timeout is not None:
        if not _is_number(timeout) or timeout <= 0 or timeout > MAX_DEADLINE_AHEAD_S:
            raise InvalidRequest("timeout", "must be a positive number of seconds")
        return "", repr(float(timeout))
    return "", repr(float(default_timeout_s))


class Pipeline:
    """A client bound to one :class:`Settings` (one Redis, one set of queues)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = check_gates(settings or load_settings())
        self.store = Store(self.settings)
        self._result_list = {
            name: self.store.for_pool(q.worker_pool_id).result_list_args(q)
            for name, q in self.settings.queues.items()
        }
        self._gates: dict[str, Gate] = {}
        self._quota_specs: dict[str, list[QuotaSpec]] | None = None
        self._lock = threading.Lock()
        # the store epoch this client stored under (docs/production.md, "A wiped Redis"):
        # asked at its first submit, and at the first after it saw the state lost
        self.epoch = Epoch(self.store, f"client {socket.gethostname()}.{os.getpid()}")
        self._adopt_epoch = False
        self._epoch_now: str | None = None  # the epoch found when the loss was seen
        # a request's own headers may not name these: the pipeline sets them
        self.reserved_headers = ATTEMPT_HEADERS | CONNECTION_HEADERS | self.settings.stamped_headers

    # -- validation ----------------------------------------------------------------------
    def queue_config(self, name: Any) -> QueueConfig:
        if not isinstance(name, str) or name not in self.settings.queues:
            raise InvalidRequest("queue", f"unknown queue {name!r}")
        return self.settings.queues[name]

    def prepare(self, payload: Any, **kw: Any) -> RequestRow:
        """Check one submission without storing it: its row for submit.lua (also
        how ``pipeline.batch`` checks batch lines). Raises InvalidRequest naming the field."""
        unknown = set(kw) - SUBMIT_KEYS
        if unknown:
            raise InvalidRequest(sorted(unknown)[0], "unknown argument")
        q = self.queue_config(kw.get("queue", "default"))
        body, size = _check_payload(payload, self.settings.max_payload_bytes)
        rid = _check_id(kw.get("id"))
        priority = check_priority(kw.get("priority", 0))
        deadline, timeout = _check_deadline(
            kw.get("deadline"), kw.get("timeout"), q.default_timeout_s
        )
        metadata = json.dumps(_str_map(kw.get("metadata"), "metadata"))
        headers = json.dumps(check_headers(kw.get("headers"), self.reserved_headers))
        _check_size(size, metadata, headers, self.settings.max_payload_bytes)
        endpoint = check_endpoint(kw.get("endpoint"))
        result_list, result_list_max, result_list_ttl = self._result_list[q.queue_name]
        return RequestRow(
            id=rid,
            queue=q.queue_name,
            pool=q.worker_pool_id,
            priority=str(priority),
            deadline=deadline,
            timeout=timeout,
            payload=body,
            metadata=metadata,
            headers=headers,
            endpoint=endpoint,
            result_list=result_list,
            result_list_max=result_list_max,
            result_list_ttl=result_list_ttl,
            labels=json.dumps(q.labels),
        )

    # -- submit --------------------------------------------------------------------------
    def submit(self, payload: dict[str, Any], **kw: Any) -> Request:
        """Submit one request. See :func:`pipeline.submit`; raises
        :class:`~pipeline.IdempotencyConflict` for a live id with other content."""
        row = self.prepare(payload, **kw)
        created = self._store([row])[0]
        return Request(self, row.id, created == 1)

    def submit_many(self, items: Iterable[dict[str, Any]]) -> list[Request]:
        """Submit many requests in one round trip per 500. All are validated first: one bad
        item raises InvalidRequest (its index in ``item`` and the message) and nothing is
        submitted. An item reusing a live id with other content is not stored:
        IdempotencyConflict names the first such, after the others were stored (``stored``:
        their ids). The items are stored in chunks (32, then doubling up to 500), each all
        or nothing: a Redis at its maxmemory raises :class:`~pipeline.StoreFull`, whose
        ``stored`` and ``not_stored`` name the ids on either side of the refused chunk."""
        rows: list[RequestRow] = []
        if isinstance(items, str | bytes | dict) or not isinstance(items, Iterable):
            raise InvalidRequest("items", "must be a list (an iterable) of dicts")
        for i, item in enumerate(items):
            if not isinstance(item, dict) or "payload" not in item:
                raise InvalidRequest("payload", "must be a dict with a 'payload'", item=i)
            kw = dict(item)
            payload = kw.pop("payload")
            try:
                rows.append(self.prepare(payload, **kw))
            except InvalidRequest as exc:
                raise InvalidRequest(exc.field, exc.reason, item=i) from None
        created = self._store(rows) if rows else []
        return [Request(self, r.id, c == 1) for r, c in zip(rows, created, strict=True)]

    def _store(self, rows: list[RequestRow]) -> list[Any]:
        """Store the rows; a :class:`ReplicationError` (too few replicas confirmed them in
        time: ``PIPELINE_REDIS_MIN_REPLICAS``) carries their ids, to submit them again."""
        if self.epoch.known is None or self._adopt_epoch:
            self._adopt_epoch = False
            self.epoch.known = self.epoch.ask().id
        try:
            # one atomic submit per pool's store (on a Redis Cluster each pool is one slot)
            groups: dict[Store, list[int]] = {}
            for i, row in enumerate(rows):
                groups.setdefault(self.store.for_pool(row.pool), []).append(i)
            out: list[Any] = [None] * len(rows)
            for store, index in groups.items():
                try:
                    replies = store.submit([rows[i] for i in index])
                except StoreFull as exc:  # the other pools' rows: stored before, or not at all
                    done = {rows[i].id for i in index} - set(exc.not_stored)
                    done |= {r.id for r, c in zip(rows, out, strict=True) if c is not None}
                    exc.stored = [r.id for r in rows if r.id in done]
                    exc.not_stored = [r.id for r in rows if r.id not in done]
                    raise
                for i, reply in zip(index, replies, strict=True):
                    out[i] = reply
        except ReplicationError as exc:
            exc.ids = [r.id for r in rows]
            raise
        conflicts = [(r, str(c)) for r, c in zip(rows, out, strict=True) if conflict(c)]
        if conflicts:  # the others are stored (or found live) as usual
            row, reply = conflicts[0]
            stored = [r.id for r, c in zip(rows, out, strict=True) if not conflict(c)]
            raise IdempotencyConflict(row.id, reply.removeprefix("conflict:").split(","), stored)
        return out

    def lost(self, ids: list[str]) -> StateLost | None:
        """Whether the Redis state was lost since this client stored under its epoch (one
        round trip; a gone epoch is written anew): a :class:`~pipeline.StateLost` naming
        ``ids`` (records found missing), else None. Until this client submits again, every
        missing record it asks about is reported lost."""
        if self.epoch.known is None:
            return None
        seen = self.epoch.ask()
        if seen.id == self.epoch.known:
            return None
        self._adopt_epoch = True
        self._epoch_now = seen.id
        return StateLost(list(ids), seen.lost_at)

    def _unknown(self, request_id: str) -> PipelineError:
        """The error for an id without a record: StateLost when the state was lost since this
        client stored, else UnknownRequest."""
        return self.lost([request_id]) or UnknownRequest(request_id)

    def store_of(self, queue: str) -> Store:
        """The store of the queue's pool (its own hash slot on a Redis Cluster)."""
        return self.store.for_pool(self.queue_config(queue).worker_pool_id)

    # -- reading -------------------------------------------------------------------------
    def _stores(self) -> list[Store]:
        return self.store.every_pool(self.settings.pools())

    def where(self, request_id: str) -> Store:
        """The store of the request's pool (:meth:`Store.find`); InvalidRequest("id") for an
        id no request can have."""
        check_lookup_id(request_id)
        return self.store.find(request_id, self.settings.queues.values())

    def get(self, request_id: str) -> Request:
        store = self.where(request_id)
        if not store.client.exists(store.keys.request(request_id)):
            raise self._unknown(request_id)
        return Request(self, request_id, created=False)

    def state(self, request_id: str) -> str:
        store = self.where(request_id)
        state = store.client.hget(store.keys.request(request_id), "state")
        if state is None:
            raise self._unknown(request_id)
        return str(state)

    def record(self, request_id: str) -> dict[str, Any]:
        return dict(self.where(request_id).record(request_id))

    def wait(self, request_id: str, timeout: float | None = None) -> Result:
        """Block until the request's terminal result exists, woken by its notify list (only
        kept for a request a client waits for: see wait.lua). Rides over Redis being
        unreachable for up to :data:`OUTAGE_S` (a restart); raises
        :class:`~pipeline.StateLost` when the record went with a Redis that lost its state."""
        end = None if timeout is None else time.monotonic() + timeout
        store = self.where(request_id)
        notify = store.keys.notify(request_id)
        key = store.keys.request(request_id)
        state, raw = store.scripts.wait(keys=[key])
        down: float | None = None  # since when Redis has been unreachable (monotonic)
        while state != "done" or not raw:
            if state is None:
                raise self._unknown(request_id)
            left = 1.0 if end is None else min(1.0, end - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"request {request_id} not done after {timeout} s")
            try:
                # BLMOVE of the list onto itself wakes on the bell and leaves it, for other
                # waiters and with its expiry (a pop then a push would re-create it without
                # one); a float timeout: redis-py's blmove() types it int
                store.client.execute_command(
                    "BLMOVE", notify, notify, "RIGHT", "LEFT", max(left, 0.01)
                )
                state, raw = store.client.hmget(key, ["state", "result"])
                down = None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                down = _outage(down, exc)
                time.sleep(max(0.0, min(0.5, left)))
        return Result.from_dict(store.with_body(json.loads(raw)))

    def load_result(self, text: str | bytes) -> Result:
        """A stored result's JSON (a result-list entry, the record's ``result``) as a
        :class:`Result`, with its body: an answer longer than ``PIPELINE_BODY_INLINE_MAX`` is
        stored once, in the key its ``payload_ref`` names, and read from there. Raises
        UnknownRequest when that body has expired."""
        data = json.loads(text)
        store = self.where(str(data["id"])) if "payload_ref" in data else self.store
        return Result.from_dict(store.with_body(data))

    def iter_results(
        self, ids: Iterable[str], poll_s: float = 0.05, on_poll: Callable[[], None] | None = None
    ) -> Iterator[Result]:
        """Yield the results of ``ids`` as they finish (in finish order). ``on_poll`` runs
        after every polling round (it may raise to stop waiting)."""
        remaining = set(ids)
        client = self.store.client
        queues = [
            (self.store.for_pool(q.worker_pool_id).keys, q.queue_name)
            for q in self.settings.queues.values()
        ]
        records = [s.keys for s in self._stores()]  # where a request's record may be
        since = "-inf"  # the recent set is scored by the server's clock: so is `since`
        last_full = float("-inf")  # the first round reads every id
        down: float | None = None  # since when Redis has been unreachable (monotonic)
        while remaining:
            try:
                sec, usec, recent = self._recent(queues, since, remaining)
                down = None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                down = _outage(down, exc)
                time.sleep(max(poll_s, 0.2))
                continue
            if time.monotonic() - last_full > FULL_RESCAN_S:  # a safety net
                candidates = list(remaining)
                last_full = time.monotonic()
            else:
                found = {i for ids_ in recent for i in ids_}
                candidates = [i for i in found if i in remaining]
            since = repr(sec + usec / 1e6 - 1.0)
            for i in range(0, len(candidates), 1000):
                chunk = candidates[i : i + 1000]
                with client.pipeline(transaction=False) as p:
                    for rid in chunk:
                        for keys in records:
                            p.hget(keys.request(rid), "result")
                    replies = iter(p.execute())
                    for rid in chunk:
                        res = next(filter(None, [next(replies) for _ in records]), None)
                        if res:
                            remaining.discard(rid)
                            yield self.load_result(res)
            if on_poll is not None:
                on_poll()
            if remaining:
                time.sleep(poll_s)

    def _recent(
        self, queues: list[tuple[Keys, str]], since: str, waiting: set[str]
    ) -> tuple[int, int, list[Any]]:
        """The server's clock and each queue's ids finished since ``since``, with the store
        epoch in the same round trip: StateLost when it moved and records of ``waiting`` are
        gone."""
        client = self.store.client
        sec, usec = client.time()  # first (a cluster pipeline sends no TIME)
        with client.pipeline(transaction=False) as p:
            for keys, q in queues:
                p.zrangebyscore(keys.recent(q), since, "+inf")
            p.hget(self.store.keys.epoch(), "id")
            *recent, epoch = p.execute()
        if self.epoch.known is not None and epoch != self.epoch.known:
            self._raise_lost(waiting)
        return sec, usec, recent

    def _raise_lost(self, ids: set[str]) -> None:
        """The epoch moved while waiting for ``ids``: StateLost naming those whose records are
        gone (if any are: a moved epoch with every record in place is no loss for them)."""
        lost = self.lost([])
        if lost is None:
            return
        records = [s.keys for s in self._stores()]
        order = sorted(ids)
        with self.store.client.pipeline(transaction=False) as p:
            for rid in order:
                for keys in records:
                    p.exists(keys.request(rid))
            found = iter(p.execute())
        gone = [rid for rid in order if not any(next(found) for _ in records)]
        if gone:
            raise StateLost(gone, lost.noticed_at)
        self.epoch.known = self._epoch_now  # all there: stored after the loss

    def cancel(self, request_id: str, running: str = "finish", by: str | None = None) -> bool:
        """Cancel the request; True when this call cancelled it. One that has not started an
        attempt ends ``CANCELLED`` at once. A running one: ``running="finish"`` (the default)
        ends it unsent if its attempt still waits for a gate slot, else lets the call finish
        (False); ``running="abort"`` ends it now: its call's connection is closed wherever it
        runs (a model server stops generating), its late answer discarded (True). ``by``:
        who asks, for :meth:`explain` (default: this client's user and host). Raises
        UnknownRequest for an id no record has (never submitted, or its result expired)."""
        if not isinstance(running, str) or running not in CANCEL_RUNNING:
            raise InvalidRequest("running", f"must be one of {', '.join(CANCEL_RUNNING)}")
        store = self.where(request_id)
        cancelled = store.cancel(request_id, running, canceller(by))
        if cancelled is None:
            raise self._unknown(request_id)
        return cancelled

    def explain(self, request_id: str) -> Explanation:
        """Where the request is and why (:class:`Explanation`); raises UnknownRequest."""
        raw = self.where(request_id).explain(request_id, self.quota_specs())
        if raw is None:
            raise self._unknown(request_id)
        queue = str((raw.get("record") or {}).get("queue", ""))
        q = self.settings.queues.get(queue)
        gate = self.gate(queue).describe() if q is not None else None
        return build(request_id, raw, gate, q.max_attempts if q is not None else None)

    def quota_specs(self) -> dict[str, list[QuotaSpec]]:
        """Per queue, the blocking concurrency quotas the dispatcher counts per tenant."""
        with self._lock:
            if self._quota_specs is None:
                self._quota_specs = {
                    name: attempt_gate(self.settings, name, None).quota_specs()
                    for name in self.settings.queues
                }
            return self._quota_specs

    # -- gates and inspection ------------------------------------------------------------
    def gate(self, queue: str) -> Gate:
        with self._lock:
            gate = self._gates.get(queue)
            if gate is None:
                store = self.store_of(queue)
                gate = queue_gate(self.settings, queue, GateEnv(store.client, store.keys))
                self._gates[queue] = gate
            return gate

    def inspect(self) -> dict[str, Any]:
        """Per queue: ``pending``, ``retry_wait``, ``running``, the gate, and for a queue indexed
        by tenant ``tenants``: ``ready`` and ``held_back`` (at a quota key's limit) tenants."""
        names = list(self.settings.queues)
        keys = {
            n: self.store.for_pool(q.worker_pool_id).keys for n, q in self.settings.queues.items()
        }
        with self.store.client.pipeline(transaction=False) as p:
            for name in names:
                k = keys[name]
                p.zcard(k.pending(name))
                p.zcard(k.delayed(name))
                p.zcard(k.active(name))
                p.exists(k.sched(name))
                p.zcard(k.ready(name))
                p.hlen(k.blocked(name))
            for name in names:  # the dispatcher of the queue's pool flags it
                p.hget(keys[name].wedged(), name)
            replies = p.execute()
        counts, wedged = replies[: 6 * len(names)], replies[6 * len(names) :]
        out: dict[str, Any] = {}
        for i, name in enumerate(names):
            q = self.settings.queues[name]
            pending, delayed, active, indexed, ready, blocked = counts[6 * i : 6 * i + 6]
            out[name] = {
                "queue_id": q.queue_id,
                "pool": q.worker_pool_id,
                "pending": pending,
                "retry_wait": delayed,
                "running": active,
                "gate": self.gate(name).describe(),
                "wedged_since": float(wedged[i]) if wedged[i] else None,
                "tenants": {"ready": ready, "held_back": blocked} if indexed else None,
            }
        return out


def _outage(since: float | None, exc: redis.RedisError) -> float:
    """When Redis became unreachable (``since``, or now); raises ``exc`` once that is
    :data:`OUTAGE_S` ago."""
    now = time.monotonic()
    if since is not None and now - since > OUTAGE_S:
        raise exc
    return now if since is None else since


@dataclass(frozen=True)
class Request:
    """A handle on a submitted request. Cheap: it holds only the id and the pipeline."""

    _pipeline: Pipeline = field(repr=False, compare=False)
    id: str
    created: bool = field(default=True, compare=False)  # False: submit() found it live

    def state(self) -> str:
        """One of ``queued``, ``retry_wait``, ``dispatched``, ``running``, ``done``."""
        return self._pipeline.state(self.id)

    def result(self, timeout: float | None = None) -> Result:
        """Block until the terminal result arrives; raises TimeoutError after ``timeout`` s."""
        return self._pipeline.wait(self.id, timeout)

    def cancel(self, running: str = "finish", by: str | None = None) -> bool:
        """Cancel it (:meth:`Pipeline.cancel`); True when this call cancelled it."""
        return self._pipeline.cancel(self.id, running, by)

    def explain(self) -> Explanation:
        """Where the request is and why (docs/observability.md, "Explain"): ``.to_text()`` for
        people, ``.to_dict()`` for JSON. Raises ``UnknownRequest`` once the record is gone."""
        return self._pipeline.explain(self.id)

    def info(self) -> dict[str, Any]:
        """The raw request record (for debugging)."""
        return self._pipeline.record(self.id)


# -- the default pipeline, configured from the environment -------------------------------
_default: Pipeline | None = None
_default_lock = threading.Lock()


def default_pipeline() -> Pipeline:
    global _default
    with _default_lock:
        if _default is None:
            _default = Pipeline()
        return _default


def configure(settings: Settings | None = None, **overrides: Any) -> Pipeline:
    """Replace the default pipeline: from ``settings``, or the environment plus overrides
    (e.g. ``configure(redis_url=..., queues=[{...}])``). A bad setting raises ConfigError
    naming it (``.field``) and keeps the pipeline there was."""
    global _default
    if settings is not None and not isinstance(settings, Settings):
        raise ConfigError("configure: settings must be a Settings (or None)", field="settings")
    base = settings or load_settings()
    if overrides:
        base = with_overrides(base, **overrides)
    with _default_lock:
        _default = Pipeline(base)
        return _default
