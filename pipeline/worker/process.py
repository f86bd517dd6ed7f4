"""Per-process worker state (:class:`Runtime`): the store, the gates, the release bell, the
heartbeat renewing live leases, and the node's config snapshot a prefork child follows."""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import replace
from typing import Any, TypeVar

from redis.exceptions import OutOfMemoryError, RedisError

from ..config import QueueConfig, Settings, from_snapshot, load_settings, to_snapshot
from ..gates import Gate, GateEnv, attempt_gate, check_gates, same_attempt_gate
from ..http.call import reset_tls
from ..observability import tracing
from ..store import Store, run_batch
from ..store.journal import entry
from . import observe
from .attempt import Attempt
from .bell import ReleaseBell
from .endpoints import check_endpoints
from .guard import LeaseGuard
from .identity import NO_HOOKS, AttemptId, Hooks
from .malloc import fix_mmap_threshold
from .reservation import Reservation

log = logging.getLogger("pipeline.worker")

T = TypeVar("T")
FULL_RETRY_S = 1.0  # a start a full Redis refused is due again after this (no hot loop)
SNAPSHOT_ENV = "PIPELINE_CONFIG_SNAPSHOT"  # the node's accepted queue config, for its children


class Runtime:
    def __init__(self, settings: Settings, snapshot: tuple[int, int, int] | None = None) -> None:
        fix_mmap_threshold()  # large answers: RSS of their copies, not twice that
        self.settings = check_gates(settings)
        check_endpoints(self.settings)  # a queue's API key variable is set, its TLS files load
        self.store = Store(self.settings)
        self.node = os.environ.get("PIPELINE_NODE") or f"{os.uname().nodename}.{os.getpid()}"
        self._envs: dict[str, GateEnv] = {}
        self._gates: dict[str, Gate] = {}
        self._pool_gates: dict[str, Gate | None] = {}
        self._live: dict[str, Attempt] = {}  # holder -> its attempt (renewed on its gate)
        self._holders: dict[str, set[str]] = {}  # request id -> its live holders here
        self._lock = threading.RLock()
        self._snapshot = snapshot  # the stamp of the node's config snapshot applied, if any
        self._heartbeat: threading.Thread | None = None
        self._watch: threading.Thread | None = None
        self.guard = LeaseGuard(self.settings.lease_s)  # stops acting before leases can lapse
        self._stopping = threading.Event()
        self.rng = random.Random()
        pools = self.store.every_pool(settings.pools())
        self.bell = ReleaseBell(
            self.store.client,
            sorted({s.keys.freed_channel() for s in pools}),
            sorted({s.keys.abort_channel() for s in pools}),
        )
        self.bell.on_abort = self.abort
        self.bell.on_lost = self.renew_live  # Redis lost its state: vanished holders stop now

    def store_of(self, queue: QueueConfig) -> Store:
        """The store of the queue's pool (its own slot on a Redis Cluster)."""
        return self.store.for_pool(queue.worker_pool_id)

    def env(self, pool: str) -> GateEnv:
        """What the gates of ``pool``'s queues bind to (its keys)."""
        env = self._envs.get(pool)
        if env is None:
            store = self.store.for_pool(pool)
            env = self._envs[pool] = GateEnv(store.client, store.keys, node=self.node)
        return env

    def gate(self, queue: str) -> Gate:
        with self._lock:
            gate = self._gates.get(queue)
            if gate is None:
                env = self.env(self.settings.queues[queue].worker_pool_id)
                gate = attempt_gate(self.settings, queue, env, self._pool_gates)
                self._gates[queue] = gate
            return gate

    def current_gate(self, queue: str) -> Gate | None:
        """The queue's gate under the current config; None for a queue it no longer has."""
        return self.gate(queue) if queue in self.settings.queues else None

    def apply(self, settings: Settings) -> None:
        """Switch to reloaded settings; a changed gate is built anew on first use."""
        with self._lock:
            old, self.settings = self.settings, settings
            self.guard.lease_s = settings.lease_s
            for name in list(self._gates):
                if not same_attempt_gate(old, settings, name):
                    del self._gates[name]
            for pool in list(self._pool_gates):
                if old.pool_configs.get(pool) != settings.pool_configs.get(pool):
                    del self._pool_gates[pool]
        reset_tls()  # new connections load the TLS files again (a rotated certificate)

    def follow_snapshot(self) -> bool:
        """Apply the node's config snapshot if it moved (a prefork child after a reload)."""
        stamp = _snapshot_stamp()
        if stamp is None or stamp == self._snapshot:
            return False
        with self._lock:
            if stamp == self._snapshot:
                return False
            self._snapshot = stamp
            try:
                settings = read_snapshot(self.settings)
            except Exception as exc:  # noqa: BLE001 - keep the config this process has
                log.error("cannot read the node's config snapshot: %s", exc)
                return False
            self.apply(settings)
        log.info("followed the node's config reload (%d queues)", len(settings.queues))
        return True

    def publish_snapshot(self) -> None:
        """Write this runtime's queues and pools for the node's prefork children."""
        path = os.environ.get(SNAPSHOT_ENV)
        if not path:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(to_snapshot(self.settings), fh)
        os.replace(tmp, path)
        self._snapshot = _snapshot_stamp()

    def _track(self, attempt: Attempt) -> None:
        self.bell.listen_for_aborts()  # an abort notice reaches the attempt wherever it is
        with self._lock:
            self._live[attempt.holder] = attempt
            self._holders.setdefault(attempt.id, set()).add(attempt.holder)
            if self._heartbeat is None or not self._heartbeat.is_alive():
                self._heartbeat = threading.Thread(
                    target=self._beat, name="pipeline-heartbeat", daemon=True
                )
                self._heartbeat.start()
            if self._watch is None or not self._watch.is_alive():
                self._watch = threading.Thread(
                    target=self._guard, name="pipeline-lease-guard", daemon=True
                )
                self._watch.start()

    def _guard(self) -> None:
        """Stop the attempts whose leases could lapse: no renewal taken by Redis within the
        guard's budget (a blackholed connection blocks the heartbeat itself: this thread
        never talks to Redis)."""
        while not self._stopping.wait(self.guard.period()):
            with self._lock:
                live = list(self._live.values())
            self._stop_late(live, time.monotonic())

    def _stop_late(self, live: list[Attempt], now: float) -> None:
        """Stop those of ``live`` past their budget ``now``: their calls are closed and they
        end as retries (released when Redis answers again, else by the reaper)."""
        late = [a for a in live if self.guard.late(a.reservation.proof, now) and not a.abort.fired]
        if not late:
            return
        self.guard.lapse(len(late))
        for a in late:
            a.lapsing = True
            if a.abort.fire():
                log.warning("request %s: attempt %s aborted: its lease could lapse", a.id, a.token)
                observe.lease_lapsed(a)

    def _beat(self) -> None:
        period = max(0.05, self.settings.lease_s / 3.0)
        while not self._stopping.wait(period):
            self.renew_live()

    def renew_live(self) -> None:
        """Renew the leases of this process's live attempts; abort those no longer current
        (reaped, cancelled with running="abort", or their record gone with a Redis that lost
        its state). The heartbeat's step, also run at once on a LOST_NOTICE."""
        with self._lock:
            live = list(self._live.values())
        if live:
            try:
                self._renew(live)
            except Exception as exc:  # noqa: BLE001 - keep beating; leases tolerate a miss
                log.warning("lease renewal failed: %s", exc)

    def _renew(self, live: list[Attempt]) -> None:
        """Renew the leases of ``live``: their requests' and their gates'. A renewal answered
        past an attempt's budget may have come too late (a lapsed lease is not revived): those
        are stopped; the others' leases last from the renewal's send time."""
        sent = time.monotonic()
        by_pool: dict[str, list[Attempt]] = {}
        for a in live:  # one call per pool's slot (and chunk)
            by_pool.setdefault(a.queue.worker_pool_id, []).append(a)
        for pool, attempts in by_pool.items():
            for part in chunks(attempts):
                stale = self.store.for_pool(pool).renew(
                    [(a.id, a.token, a.queue.queue_name) for a in part]
                )
                if stale:  # their results would be discarded: stop their calls
                    self.abort(stale)
        by_gate: dict[int, tuple[Gate, list[str]]] = {}
        for a in live:  # each on the gate it holds (or asks)
            gate = a.reservation.gate
            by_gate.setdefault(id(gate), (gate, []))[1].append(a.holder)
        for gate, holders in by_gate.values():
            for names in chunks(holders):
                gate.renew(names, self.settings.lease_s)
        self._stop_late(live, time.monotonic())
        for a in live:
            a.reservation.proof = max(a.reservation.proof, sent)
        self.guard.renewed()

    def abort(self, ids: list[str]) -> None:
        """Close the calls of this process's attempts of ``ids`` (an abort notice, or found
        fenced off at renewal): each then ends, releasing its reservation."""
        with self._lock:  # by id: a node with thousands running gets one notice per cancel
            hits = [self._live[h] for rid in set(ids) for h in self._holders.get(rid, ())]
        for a in hits:
            if a.abort.fire():
                log.info("request %s: attempt %s aborted (cancelled, or no longer its own)",
                         a.id, a.token)  # fmt: skip

    def untrack(self, holder: str) -> None:
        with self._lock:
            attempt = self._live.pop(holder, None)
            if attempt is not None:
                held = self._holders.get(attempt.id)
                if held is not None:
                    held.discard(holder)
                    if not held:
                        del self._holders[attempt.id]

    def live_attempts(self) -> list[AttemptId]:
        """Who this process's live attempts are (each with the queue it runs on)."""
        with self._lock:
            return [replace(a.who, queue=a.queue.queue_name) for a in self._live.values()]

    def begin(self, who: AttemptId, worker: str, hooks: Hooks = NO_HOOKS) -> Attempt | None:
        """Start attempt ``who`` (fenced by its token), with the gate's acquire in the same round
        trip when it can (``Reservation.start_calls``, for the tenant and priority the
        dispatcher named); None for a stale message. ``hooks``: the task's, for the attempt."""
        self.follow_snapshot()
        request_id, token, tenant, priority = who.request_id, who.token, who.tenant, who.priority
        queue = who.queue if who.queue in self.settings.queues else self._queue_of(request_id)
        gate = self.current_gate(queue)
        store = self._store_of(queue, request_id)
        res = None if gate is None else Reservation(self, queue, who.holder, gate)
        calls = None if res is None else res.start_calls(worker, tenant or {}, priority)
        began = time.monotonic()  # its leases last from after this (the lease guard's count)
        start = store.start_call(request_id, token, queue, worker)
        took = False
        if res is None or calls is None:
            try:
                reply: Any = start()
            except OutOfMemoryError as exc:
                reply = exc
        else:
            reply, *acquired = run_batch(store.client, [start, *calls.calls])
            took = res.started(calls, acquired)
        started = None if isinstance(reply, Exception) else store.started(reply)
        if started is None:
            if took and res is not None:  # the start failed or was fenced off: give it back
                res.release()
            if isinstance(reply, OutOfMemoryError):
                self._give_back_full(store, request_id, token)
                return None
            if isinstance(reply, Exception):
                raise reply
            return None
        try:
            attempt = Attempt(self, started.record, who, worker, started.clock_offset, res, hooks)
            attempt.reservation.proof = min(attempt.reservation.proof, began)
        except (KeyError, ValueError, TypeError) as exc:
            # a record this worker cannot read (written by hand, or corrupted): end it
            message = f"unreadable request record: {type(exc).__name__}: {exc}"
            log.error("request %s: %s", request_id, message)
            if res is not None and (took or res.admitted):
                res.release()
            self._fail(store, request_id, token, "INVALID_REQUEST", message, message)
            return None
        named = tenant and any(attempt.metadata.get(k) != v for k, v in tenant.items())
        if named or (priority is not None and took and priority != attempt.priority):
            # the dispatcher's tenant or priority is not the record's: ask the gate anew
            attempt.reservation.discard()
        self._track(attempt)
        return attempt

    def _give_back_full(self, store: Store, request_id: str, token: str) -> None:
        """A start Redis refused for want of memory (``maxmemory``): give the request back
        to its queue now, due after :data:`FULL_RETRY_S`, instead of leaving it dispatched
        until its lease lapses. requeue.lua's first write only shrinks (a ZREM), so a full
        Redis runs it (docs/production.md, "Redis memory")."""
        note = entry("requeued", reason="Redis at maxmemory: the start could not write")
        try:
            done = store.requeue(request_id, token, delay=FULL_RETRY_S, attempted=False,
                                 note=note)  # fmt: skip
        except RedisError as exc:  # its lease brings it back
            log.error("request %s: start refused (Redis at maxmemory), and so was giving it "
                      "back: %s", request_id, exc)  # fmt: skip
            return
        log.error("request %s: start refused: Redis is at its maxmemory; given back to its "
                  "queue (due again in %.0f s)%s", request_id, FULL_RETRY_S,
                  "" if done else " (fenced off: nothing to give back)")  # fmt: skip

    def _queue_of(self, request_id: str) -> str:
        store = self.store.find(request_id, self.settings.queues.values())
        return str(store.client.hget(store.keys.request(request_id), "queue") or "")

    def _store_of(self, queue: str, request_id: str) -> Store:
        q = self.settings.queues.get(queue)
        return self.store_of(q) if q else self.store.find(request_id, self.settings.queues.values())

    def abandon(
        self,
        who: AttemptId,
        *,
        cancel: bool,
        reason: str,
        reservation: Reservation | None = None,
    ) -> None:
        """An attempt ended without reporting (hard time limit, killed child, revoke,
        shutdown): release (``reservation``: its own, in this process: unless released
        already), then requeue or cancel it. Fenced: a no-op once it finished."""
        request_id, token = who.request_id, who.token
        queue = who.queue or self._queue_of(request_id)
        gate = self.current_gate(queue)
        if reservation is not None:
            reservation.close()
        elif gate is not None:
            Reservation(self, queue, who.holder, gate).release()
        store = self._store_of(queue, request_id)
        done: object
        if cancel:
            done = self._fail(store, request_id, token, "CANCELLED", reason, "cancelled")
        else:
            done = store.requeue(
                request_id, token, delay=0.0, attempted=False, note=entry("requeued", reason=reason)
            )
        if done:
            log.warning(
                "request %s attempt %s abandoned (%s): %s",
                request_id,
                token,
                reason,
                "cancelled" if cancel else "requeued",
            )
            if not cancel:
                tracing.reenqueue_span(
                    request_id,
                    token,
                    reason,
                    queue_name=queue,
                    noted=lambda: store.attempt_span(request_id, token),
                )

    def _fail(
        self, store: Store, request_id: str, token: str, code: str, message: str, error: str
    ) -> bool:
        """End a request unsent with error ``code``; False when fenced off."""
        payload = json.dumps({"error": error})
        done = store.finish(
            request_id,
            token,
            attempted=False,
            status_code=None,
            payload=payload,
            error_code=code,
            error_message=message,
        )
        return done is not None

    def stop(self) -> None:
        self._stopping.set()
        self.bell.stop()


RENEW_CHUNK = 500  # leases renewed per script call: a node with thousands running sends a few


def chunks(items: list[T]) -> list[list[T]]:
    """``items`` in runs of at most :data:`RENEW_CHUNK`, so no renewal holds Redis long."""
    return [items[i : i + RENEW_CHUNK] for i in range(0, len(items), RENEW_CHUNK)]


def _snapshot_stamp() -> tuple[int, int, int] | None:
    path = os.environ.get(SNAPSHOT_ENV)
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def read_snapshot(base: Settings) -> Settings:
    path = os.environ[SNAPSHOT_ENV]
    with open(path, encoding="utf-8") as fh:
        data: Any = json.load(fh)
    return from_snapshot(base, data, path)


def node_settings() -> Settings:
    """A new process's settings: the node's accepted config snapshot when there is one (so a
    child forked after a reload runs what the node runs), else the environment and files."""
    if _snapshot_stamp() is None:
        return load_settings()
    base = {k: v for k, v in os.environ.items() if k not in ("PIPELINE_QUEUES", "PIPELINE_POOLS")}
    try:
        return read_snapshot(load_settings(base))
    except Exception as exc:  # noqa: BLE001 - the files, as at start, rather than nothing
        log.error("cannot read the node's config snapshot, using the files: %s", exc)
        return load_settings()


_runtimes: dict[int, Runtime] = {}
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    """This process's runtime (a new one after a fork)."""
    pid = os.getpid()
    with _runtime_lock:
        rt = _runtimes.get(pid)
        if rt is None:
            _runtimes.clear()
            stamp = _snapshot_stamp()  # before reading: a newer file is followed later
            rt = _runtimes[pid] = Runtime(node_settings(), stamp)
        return rt
