"""The dispatcher: moves the heads of a pool's queues into Celery, as many as there are free
worker slots and as each queue's gate budget allows, so Celery's execution order mirrors the
sorted-set order. The pool's merge policy shares the dispatches among its queues
(``PIPELINE_MERGE_POLICY``); a queue with ``fair_share`` or a per-key quota is *indexed* by
tenant (``pipeline.store.sched``), so tenants take turns and a tenant at its quota is held
back instead of being sent to a refusal. For a slot gate (one with a capacity) it sends a few
attempts more than there are slots (``Settings.lookahead_for``, for each node of the pool),
and likewise past a quota key's limit: they park at the workers and take a released slot at
once (``pipeline.bell``).
It is event-driven: a submission, a finished attempt or a due retry rings the pool's doorbell
(a Redis list it blocks on). It also registers its node's slots, and runs the reaper that
requeues attempts whose lease expired.

One dispatcher runs in every worker node (main process). Several may run against one Redis:
each tick is one atomic script for the whole pool, so they never over-dispatch or disagree.

A config reload (:meth:`Dispatcher.apply`) swaps its queues and gates between two ticks. A
queue whose gate is configured as before keeps its gate object; a changed gate is rebuilt, and
the old one is kept for the reaper until it holds nothing (its holders release on the gate
they acquired: when its keys changed, e.g. a new ``gate_type``, a reservation of a holder that
died is freed from the old keys all the same). The queues are indexed by tenant again as the
new configuration needs (``setup_queues``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable

from redis.connection import AbstractConnection

from ..config import QueueConfig, Settings
from ..gates import Gate, GateEnv, attempt_gate, dispatch_budget, same_attempt_gate, static_budget
from ..observability import metrics, tracing
from ..store import (
    DirectPublish,
    Dispatched,
    MergeArgs,
    QueueTick,
    QuotaSpec,
    Store,
    sched,
)
from ..store import holder as make_holder
from ..store.journal import entry
from ..store.scripts import ThreadConnection

log = logging.getLogger("pipeline.dispatcher")

NODE_TTL_S = 5.0  # a node missing heartbeats this long stops counting towards pool slots
MAX_IDLE_S = 1.0  # longest block on the doorbell (also the node heartbeat cadence)
INGEST_POLL_S = 0.25  # a reference producer rings no doorbell: look at its sorted set this often

Sender = Callable[[list[Dispatched]], None]


class Dispatcher:
    """Dispatch loop for the pools one worker node serves."""

    def __init__(
        self,
        settings: Settings,
        pools: list[str],
        node: str,
        slots: int,
        send: Sender,
        store: Store | None = None,
        direct: dict[str, DirectPublish] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store or Store(settings)
        self.keys = self.store.keys
        self.node = node
        self.slots = slots
        self.send = send
        # pools whose Celery queue lives in the pipeline's Redis: the dispatch script pushes
        # their messages itself (one atomic step, no publish round trip); the rest use `send`
        self.direct = direct or {}
        self._env = GateEnv(self.store.client, self.keys, node=node)
        self._lock = threading.RLock()  # a tick / reap pass, or a config swap (apply)
        self.pools: dict[str, list[QueueConfig]] = {p: [] for p in pools}
        self.gates: dict[str, Gate] = {}
        # per queue: the per-key quotas the dispatch script counts (with their look-ahead)
        self.specs: dict[str, tuple[QuotaSpec, ...]] = {}
        self.retired: list[Gate] = []  # gates replaced by a reload, reaped until empty
        self.foreign: list[QueueConfig] = []
        self.full_since: dict[str, float] = {}
        self.rng = random.Random()
        self._bind(settings)
        self.pool_cap: dict[str, int] = {p: slots for p in pools}
        self.pool_nodes: dict[str, int] = {p: 1 for p in pools}
        self._foreign_due = 0.0
        self.ingesting = any(q.ingest for qs in self.pools.values() for q in qs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_beat = 0.0
        self._next_reap = 0.0
        # the connection a fused wait blocks on (the loop thread's own): stop() drops it, so
        # the server drops the tick queued behind the wait instead of running it after the stop
        self._waiting: AbstractConnection | None = None
        self.dispatched = 0

    def _bind(self, settings: Settings, old: Settings | None = None) -> None:
        """Take ``settings``' queues of the served pools, keeping the gate of every queue
        whose gate is configured as in ``old``."""
        all_pools = settings.pools()
        pools = {p: all_pools.get(p, []) for p in self.pools}
        pool_gates: dict[str, Gate | None] = {}
        gates: dict[str, Gate] = {}
        for qs in pools.values():
            for q in qs:
                name = q.queue_name
                kept = self.gates.get(name)
                if kept is not None and old is not None and same_attempt_gate(old, settings, name):
                    gates[name] = kept
                else:
                    gates[name] = attempt_gate(settings, name, self._env, pool_gates)
        for name, gate in self.gates.items():
            if gates.get(name) is not gate:
                self.retired.append(gate)
            if name not in gates:
                self.full_since.pop(name, None)
        self.settings, self.pools, self.gates = settings, pools, gates
        self.specs = {
            name: tuple(
                dataclasses.replace(s, lookahead=settings.lookahead_for(s.limit, quota_key=True))
                for s in gate.quota_specs()
            )
            for name, gate in gates.items()
        }
        # queues of pools this node does not serve: swept (due retries promoted, expired
        # requests resulted) but never dispatched, so deadlines hold even with no worker there
        self.foreign = [q for p, qs in all_pools.items() if p not in self.pools for q in qs]

    def apply(self, settings: Settings) -> None:
        """Switch to reloaded settings between two ticks (the pools served stay the same:
        they are the node's Celery queues). A tick waiting for its doorbell is rung, so the
        switch waits for no more than that tick."""
        self._ring()
        with self._lock:
            self._bind(settings, self.settings)
            self._foreign_due = 0.0
            self.setup_queues()

    # -- lifecycle -----------------------------------------------------------------------
    def indexed(self, q: QueueConfig) -> bool:
        """Whether the queue's waiting requests are indexed by tenant: for fair share, or to
        hold tenants at a per-key quota back."""
        return q.fair_share or bool(self.specs[q.queue_name])

    def setup_queues(self) -> None:
        """Index the queues that need it (and the requests waiting in them), and stop indexing
        those that no longer do (this node's configuration decides)."""
        c, keys = self.store.client, self.keys
        for pool, queues in self.pools.items():
            for q in queues:
                if self.indexed(q):
                    n = sched.setup(
                        c,
                        self.store.scripts,
                        keys,
                        q.queue_name,
                        pool,
                        self.settings.fairness_attribute,
                        q.fair_share,
                    )
                    if n:
                        log.info("queue %s: indexed %d waiting request(s)", q.queue_name, n)
                elif sched.indexed(c, keys, q.queue_name):
                    sched.teardown(c, keys, q.queue_name)
                    log.info("queue %s: no longer indexed by tenant", q.queue_name)

    def start(self) -> Dispatcher:
        self.setup_queues()
        self._heartbeat()
        self._thread = threading.Thread(target=self._loop, name="pipeline-dispatcher", daemon=True)
        self._thread.start()
        return self

    def _ring(self) -> None:
        """Ring this node's pools' doorbells (ends a tick's wait for them)."""
        try:
            for pool in self.pools:
                self.store.client.rpush(self.keys.wake(pool), "1")
        except Exception as exc:  # noqa: BLE001 - the wait ends by itself within a second
            log.warning("could not ring the doorbell: %s", exc)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._waiting is not None:
            self._waiting.disconnect()  # ends a fused wait (its tick is dropped)
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            for pool in self.pools:
                self.store.client.zrem(self.keys.pool_nodes(pool), self.node)
                self.store.client.hdel(self.keys.pool_slots(pool), self.node)
        except Exception as exc:  # noqa: BLE001 - best effort; the entry expires anyway
            log.warning("could not deregister node %s: %s", self.node, exc)
        for gate in [*self.gates.values(), *self.retired]:
            gate.close()

    # -- node registry -------------------------------------------------------------------
    def _heartbeat(self) -> None:
        pools = list(self.pools)
        beats = self.store.node_beat(self.node, self.slots, pools, NODE_TTL_S)
        for pool, (total, live) in zip(pools, beats, strict=True):
            cap = total or self.slots
            cfg = self.settings.pool_configs.get(pool)
            self.pool_cap[pool] = min(cap, cfg.workers) if cfg else cap
            self.pool_nodes[pool] = max(1, live)
        self._next_beat = time.monotonic() + MAX_IDLE_S

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        wake_keys = [self.keys.wake(p) for p in self.pools]
        block: float | None = None
        self._waiting = ThreadConnection.of(self.store.client).get()
        while not self._stop.is_set():
            try:
                next_event = self.tick(block)
                block = None
                now = time.monotonic()
                if now >= self._next_beat:
                    self._heartbeat()
                if now >= self._next_reap:
                    self.reap()
                    self._next_reap = now + self.settings.reaper_period_s
                wait = min(INGEST_POLL_S if self.ingesting else MAX_IDLE_S, self._next_reap - now)
                if next_event is not None:
                    wait = min(wait, next_event - now)
                if wait > 0.001:
                    if self.fused():
                        block = wait  # the next tick waits for the doorbell itself
                    else:
                        self.store.client.blpop(wake_keys, timeout=wait)
            except Exception as exc:  # noqa: BLE001 - the loop must survive Redis outages
                if self._stop.is_set():
                    break  # a fused wait cut short by stop()
                log.warning("dispatcher tick failed: %s", exc)
                block = None
                self._stop.wait(0.5)

    def fused(self) -> bool:
        """Whether the loop's wait for the doorbell and the tick it wakes go to Redis in one
        round trip: one pool, no reference producer to ingest from, no other pools' queues to
        sweep, and gates whose dispatch budget never changes (the tick's arguments are computed
        before the wait)."""
        return (
            len(self.pools) == 1
            and not self.ingesting
            and not self.foreign
            and all(static_budget(g) for g in self.gates.values())
        )

    def tick(self, block: float | None = None) -> float | None:
        """Dispatch every pool once; returns when the earliest known future event is due
        (``time.monotonic()``: the scripts give delays by the server's clock). ``block`` (s,
        one pool only): the tick first waits that long for the pool's doorbell, in the same
        round trip (see ``Store.tick_pool``)."""
        with self._lock:
            return self._tick(block)

    def _tick(self, block: float | None = None) -> float | None:
        next_event: float | None = None
        for pool, queues in self.pools.items():
            # the tick empties the pool's doorbell: the rings pushed so far are all answered
            # by it, so none of them wakes a redundant tick
            ne = self._tick_pool(pool, queues, self.keys.wake(pool), block)
            if ne is not None and (next_event is None or ne < next_event):
                next_event = ne
        now = time.monotonic()
        if self.foreign and now >= self._foreign_due:
            # other pools' queues only when one of their events is due (or once a second),
            # not on every doorbell ring
            due = now + MAX_IDLE_S
            for q in self.foreign:
                res = self.store.tick(q, [q], 0.0, 0, 0)
                metrics.deadline_expired(q, res.expired[q.queue_name])
                if res.next_event is not None:
                    due = min(due, now + res.next_event)
            self._foreign_due = due
        if self.foreign and (next_event is None or self._foreign_due < next_event):
            next_event = self._foreign_due
        return next_event

    def _queue_tick(self, pool: str, q: QueueConfig) -> QueueTick:
        gate = self.gates[q.queue_name]
        cap = gate.capacity()
        specs = self.specs[q.queue_name]
        # look ahead: a few attempts past a slot gate's slots (or a quota key's limit) park at
        # each node of the pool, so a slot released there is taken by a waiter there, not
        # after a dispatcher round trip; each node keeps its own (a node rings the doorbell
        # when fewer than half of them are left there: Runtime.parked_ahead), whether the gate
        # counts per node or for the whole pool. Once in all behind a composite of per-key
        # quotas and a slot gate: its parked attempts hold their tenants' quota slots, and
        # more of them cost more than they saved (a fair tenant mix on 3 nodes: 5.5 -> 6.1
        # Redis round trips per request)
        nodes = self.pool_nodes[pool]
        per = 1 if cap is not None and specs else nodes
        if cap is not None:
            ahead = self.settings.lookahead_for(cap, behind_quota=bool(specs)) * per
            if gate.per_node:
                cap *= nodes
            cap += ahead
        if per > 1:
            specs = tuple(dataclasses.replace(s, lookahead=s.lookahead * per) for s in specs)
        return self.store.queue_tick(
            q,
            budget=dispatch_budget(gate),
            cap=-1 if cap is None else cap,
            lane=self.settings.merge_policy.lane(q.labels),
            specs=specs,
            rand=self.rng.random(),
        )

    def _tick_pool(
        self,
        pool: str,
        queues: list[QueueConfig],
        doorbell: str | None = None,
        block: float | None = None,
    ) -> float | None:
        for q in queues:
            if q.ingest:
                self._ingest(q)
        entries = [self._queue_tick(pool, q) for q in queues]
        policy = self.settings.merge_policy
        direct = self.direct.get(pool)
        res = self.store.tick_pool(
            pool,
            entries,
            self.pool_cap[pool],
            merge=MergeArgs(
                policy.type,
                policy.max_lane_wait,
                self.settings.lookahead_for(self.pool_cap[pool]),
            ),
            publish=direct,
            doorbell=doorbell,
            block=block,
        )
        for q in queues:
            metrics.deadline_expired(q, res.expired[q.queue_name])
        for name, members in res.rejected.items():
            for member in members:
                log.error("queue %s: removed a malformed entry %r", name, member[:200])
        if res.moved:
            if direct is None:
                self._send(res.moved)
            else:
                self.dispatched += len(res.moved)
            if any(e.budget < 1.0 for e in entries):
                # a fractional budget moved a share of the free room: more may fit now
                return time.monotonic()
        # otherwise the next move needs an event: a release or a submission rings the
        # doorbell, a due retry or deadline is next_event
        return None if res.next_event is None else time.monotonic() + res.next_event

    def _ingest(self, q: QueueConfig) -> None:
        """Take what a reference producer wrote into the queue's sorted set (see
        ``pipeline.store.wire``); a failure is logged and retried on the next tick."""
        try:
            outcome = self.store.ingest(q)
        except Exception as exc:  # noqa: BLE001 - the queue's own requests keep flowing
            log.warning("queue %s: ingest from %s failed: %s", q.queue_name, q.queue_name, exc)
            return
        for word, ids in outcome.items():
            if word == "invalid":
                log.error("queue %s: malformed entries answered INVALID_REQUEST: %s",
                          q.queue_name, ", ".join(i[:80] for i in ids))  # fmt: skip
            elif word not in ("ingested", "gone", "busy"):
                log.info("queue %s: %d %s entr(ies): %s", q.queue_name, len(ids), word,
                         ", ".join(i[:80] for i in ids))  # fmt: skip

    def _send(self, moved: list[Dispatched]) -> None:
        try:
            self.send(moved)
            self.dispatched += len(moved)
        except Exception as exc:  # noqa: BLE001 - put them back; the lease would also do it
            log.error("could not send %d request(s) to Celery: %s", len(moved), exc)
            for d in moved:
                note = entry("requeued", reason="could not send to Celery")
                self.store.requeue(d.id, d.token, delay=1.0, attempted=False, note=note)

    def reap(self) -> int:
        """Requeue attempts whose lease expired and free their gate reservations."""
        with self._lock:
            n = self._reap()
            self._reap_retired()
            return n

    def _reap_retired(self) -> None:
        """Free expired reservations of gates a reload replaced; forget a gate once it holds
        nothing (its live holders release on it when they end)."""
        keep = []
        for gate in self.retired:
            try:
                for h in gate.reap():
                    log.warning("retired gate %s freed expired reservation %s", gate.name, h)
                if gate.in_flight() > 0:
                    keep.append(gate)
                else:
                    gate.close()
            except Exception as exc:  # noqa: BLE001 - try again on the next pass
                log.warning("retired gate %s: %s", gate.name, exc)
                keep.append(gate)
        self.retired = keep

    def _reap(self) -> int:
        n = 0
        for queues in self.pools.values():
            for q in queues:
                gate = self.gates[q.queue_name]
                for rid, token in self.store.reap(q.queue_name):
                    gate.release(make_holder(rid, token))
                    log.warning(
                        "reaped request %s attempt %s on %s (lease expired)",
                        rid,
                        token,
                        q.queue_name,
                    )
                    n += 1
                    metrics.lease_reclaimed(q, "attempt")
                    self._trace_reenqueue(q, rid, token)
                for h in gate.reap():
                    log.warning("gate %s freed expired reservation %s", q.queue_name, h)
                    metrics.lease_reclaimed(q, "gate")
                if self.specs[q.queue_name]:
                    # tenants held back by a quota key whose wake-up was lost get another look
                    sched.recheck(self.store.scripts, self.keys, q.queue_name)
                self.check_wedge(q.queue_name, gate)
        return n

    def _trace_reenqueue(self, q: QueueConfig, request_id: str, token: str) -> None:
        """A ``re-enqueue`` span for a reaped attempt, linked to its ``process-request`` span
        (whose context the attempt left in its record). Tracing on only."""
        if not tracing.enabled():
            return
        try:
            traceparent = self.store.attempt_span(request_id, token)
            tracing.reenqueue_span(
                request_id,
                token,
                "lease expired",
                queue_name=q.queue_name,
                traceparent=traceparent,
            )
        except Exception as exc:  # noqa: BLE001 - observability never stops the reaper
            log.warning("re-enqueue span of %s failed: %s", request_id, exc)

    def check_wedge(self, queue: str, gate: Gate) -> bool:
        """A queue is wedged when requests wait, its gate is at its limit and nothing has
        finished for ``wedge_after_s`` (by the server's clock, which also timed the last
        finish): log the holders and record it (``pl:wedged``)."""
        cap = gate.capacity()
        if cap is not None and gate.per_node:
            cap *= self.pool_nodes[self.settings.queues[queue].worker_pool_id]
        c = self.store.client
        with c.pipeline(transaction=False) as p:
            p.zcard(self.keys.pending(queue))
            p.zcard(self.keys.active(queue))
            p.zrange(self.keys.recent(queue), -1, -1, withscores=True)
            p.time()
            pending, active, last, (sec, usec) = p.execute()
        now = sec + usec / 1e6
        held = gate.in_flight() if cap is not None else 0
        # waiting: in the queue, or dispatched and parked at a worker for a slot
        pending += max(0, active - held)
        full = cap is not None and pending > 0 and held >= cap
        if not full:
            self.full_since.pop(queue, None)
            c.hdel(self.keys.wedged(), queue)
            return False
        since = max(self.full_since.setdefault(queue, now), last[0][1] if last else 0.0)
        if now - since < self.settings.wedge_after_s:
            return False
        if c.hsetnx(self.keys.wedged(), queue, since):
            holders = ", ".join(
                f"{h.get('request_id')}#{h.get('attempt')}@{h.get('worker')}"
                for h in gate.holders()
            )
            log.warning(
                "queue %s looks wedged: %d waiting, gate full (%s/%s), no completion "
                "for %.0f s; holders: %s",
                queue,
                pending,
                held,
                cap,
                now - since,
                holders or "none",
            )
        return True
