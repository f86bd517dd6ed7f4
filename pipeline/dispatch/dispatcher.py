"""The dispatcher (one per worker node, main process): moves the heads of a pool's queues into
Celery as free worker slots and gate budgets allow, in one atomic script per pool and tick
(docs/architecture.md#where-dispatch-order-is-decided); registers the node's slots, runs the
reaper and the wedge detector, and swaps queues and gates on a config reload."""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from redis.connection import AbstractConnection

from ..config import QueueConfig, Settings
from ..gates import (
    Controlled,
    Gate,
    GateEnv,
    attempt_gate,
    dispatch_budget,
    same_attempt_gate,
    static_budget,
    walk,
)
from ..observability import metrics, tracing
from ..store import (
    DirectPublish,
    Dispatched,
    Epoch,
    EpochSeen,
    MergeArgs,
    QueueTick,
    QuotaSpec,
    ScriptCall,
    Store,
    TokenSpec,
    epoch_seen,
    run_batch,
    sched,
    tell_lost,
)
from ..store import holder as make_holder
from ..store.journal import entry
from ..store.scripts import ThreadConnection, node_client

log = logging.getLogger("pipeline.dispatcher")

NODE_TTL_S = 5.0  # a node missing heartbeats this long stops counting towards pool slots
MAX_IDLE_S = 1.0  # longest block on the doorbell (also the node heartbeat cadence)
INGEST_POLL_S = 0.25  # a reference producer rings no doorbell: look at its sorted set this often
CONTROL_TICK_S = 0.1  # an adaptive gate's window is asked to close this often (per node)
# after a loss of the Redis state, no dispatch for at least this long (and a heartbeat period
# of the attempts, lease / 3, more): every node hears of it (the notice, else its attempts'
# next renewal) and aborts the calls whose holders vanished from the gates
LOST_QUIET_S = 2 * MAX_IDLE_S

Sender = Callable[[list[Dispatched]], None]


def _sent_alone(call: ScriptCall) -> Any:
    """``call`` sent now; its reply, or the error it raised in its place (as run_batch)."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the caller reads it as run_batch's
        return exc


class Dispatcher:
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
        # per queue: the token budgets it holds tenants back by (and charges at dispatch)
        self.tokens: dict[str, tuple[TokenSpec, ...]] = {}
        self.retired: list[Gate] = []  # gates replaced by a reload, reaped until empty
        self.foreign: list[QueueConfig] = []
        self.full_since: dict[str, float] = {}
        self.rng = random.Random()
        self._bind(settings)
        self.pool_cap: dict[str, int] = {p: slots for p in pools}
        self.pool_nodes: dict[str, int] = {p: 1 for p in pools}
        self._capped: dict[str, tuple[int, int] | None] = {}  # warned (offered, cap) per pool
        self._foreign_due = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._controller: threading.Thread | None = None
        self._control_problem: dict[int, str] = {}
        self._next_beat = 0.0
        self._next_reap = 0.0
        self.epoch = Epoch(self.store, node)  # the store epoch this node knows
        self._quiet_until = 0.0  # monotonic: no dispatch before (after a loss of state)
        self._beat_first = False  # after a Redis error: the epoch is checked before a tick
        # the connection a fused wait blocks on (the loop thread's own): stop() drops it, so
        # the server drops the tick queued behind the wait instead of running it after the stop
        self._waiting: AbstractConnection | None = None

    def _bind(self, settings: Settings, old: Settings | None = None) -> None:
        """Take ``settings``' queues of the served pools; a gate configured as in ``old`` stays
        (a replaced one is reaped until it holds nothing)."""
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
        self.ingesting = any(q.ingest for qs in pools.values() for q in qs)
        self.specs = {
            name: tuple(
                dataclasses.replace(s, lookahead=settings.lookahead_for(s.limit))
                for s in gate.quota_specs()
            )
            for name, gate in gates.items()
        }
        self.tokens = {name: tuple(gate.token_specs()) for name, gate in gates.items()}
        # queues of pools this node does not serve: swept (due retries promoted, expired
        # requests resulted) but never dispatched, so deadlines hold even with no worker there
        self.foreign = [q for p, qs in all_pools.items() if p not in self.pools for q in qs]

    def apply(self, settings: Settings) -> None:
        """Switch to reloaded settings between two ticks (a waiting tick is rung first)."""
        try:
            for pool in self.pools:
                self.store.client.rpush(self.keys.wake(pool), "1")
        except Exception as exc:  # noqa: BLE001 - the wait ends by itself within a second
            log.warning("could not ring the doorbell: %s", exc)
        with self._lock:
            self._bind(settings, self.settings)
            self._foreign_due = 0.0
            self.setup_queues()

    def setup_queues(self) -> None:
        """Index by tenant the queues that need it (fair share, a per-key quota, a token
        budget), and only those."""
        c, keys = self.store.client, self.keys
        for pool, queues in self.pools.items():
            for q in queues:
                held_back = bool(self.specs[q.queue_name] or self.tokens[q.queue_name])
                if q.fair_share or held_back:
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
                    if not held_back:
                        # tenants a quota or token budget a reload removed held back: nothing
                        # else would make them ready (the reaper's recheck is for held_back)
                        sched.recheck(self.store.scripts, keys, q.queue_name)
                elif sched.indexed(c, keys, q.queue_name):
                    sched.teardown(c, keys, q.queue_name)
                    log.info("queue %s: no longer indexed by tenant", q.queue_name)

    def start(self) -> Dispatcher:
        self.setup_queues()
        self._heartbeat()
        self._thread = threading.Thread(target=self._loop, name="pipeline-dispatcher", daemon=True)
        self._thread.start()
        self._controller = threading.Thread(
            target=self._control_loop, name="pipeline-adaptive", daemon=True
        )
        self._controller.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._waiting is not None:
            self._waiting.disconnect()  # ends a fused wait (its tick is dropped)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._controller is not None:
            self._controller.join(timeout)
        try:
            for pool in self.pools:
                self.store.client.zrem(self.keys.pool_nodes(pool), self.node)
                self.store.client.hdel(self.keys.pool_slots(pool), self.node)
        except Exception as exc:  # noqa: BLE001 - best effort; the entry expires anyway
            log.warning("could not deregister node %s: %s", self.node, exc)
        for gate in [*self.gates.values(), *self.retired]:
            gate.close()

    def _heartbeat(self) -> None:
        """Register the node's slots, and check the store epoch in the same round trip."""
        pools = list(self.pools)
        beat = self.store.node_beat_call(self.node, self.slots, pools, NODE_TTL_S)
        if self.store.cluster and self.store.pool is None:  # another slot: a call of its own
            reply, seen = run_batch(self.store.client, [beat])[0], _sent_alone(self.epoch.call())
        else:
            reply, seen = run_batch(self.store.client, [beat, self.epoch.call()])
        if isinstance(reply, Exception):
            raise reply
        if isinstance(seen, Exception):
            log.warning("could not read the store epoch: %s", seen)
        else:
            self._epoch_seen(epoch_seen(seen))
        beats = self.store.node_beats(reply)
        for pool, (total, live) in zip(pools, beats, strict=True):
            offered = total or self.slots
            cfg = self.settings.pool_configs.get(pool)
            self.pool_cap[pool] = cfg.cap(offered) if cfg else offered
            self.pool_nodes[pool] = max(1, live)
            self._warn_capped(pool, offered, self.pool_cap[pool])
        self._next_beat = time.monotonic() + MAX_IDLE_S

    def _epoch_seen(self, seen: EpochSeen) -> None:
        """The store epoch as the heartbeat found it: gone or changed, Redis lost its state
        (docs/production.md, "A wiped Redis"): say so loudly, tell every node's attempts to
        check their leases now (those whose records are gone are aborted), and dispatch
        nothing for :data:`LOST_QUIET_S` and an attempt heartbeat period while they do."""
        if not self.epoch.changed(seen):
            return
        self._quiet_until = time.monotonic() + LOST_QUIET_S + self.settings.lease_s / 3.0
        log.error(
            "Redis lost its state (restarted without persistence, or flushed): the store "
            "epoch this node knew is gone (now %s, noticed by %s). Every request accepted "
            "before is lost: its client gets StateLost; calls still running for them are "
            "aborted. Turn on persistence (docs/production.md).",
            seen.id,
            seen.lost_by or "?",
        )
        metrics.state_lost(seen.lost_at)
        try:
            tell_lost(self.store.every_pool(self.pools))
        except Exception as exc:  # noqa: BLE001 - each attempt's heartbeat finds it too
            log.warning("could not publish the loss of state: %s", exc)

    def _warn_capped(self, pool: str, offered: int, cap: int) -> None:
        """A WARNING when the pool's ``workers`` keeps fewer attempts running than its nodes
        offer slots (at the node's start, and again whenever the figures change)."""
        capped = (offered, cap) if cap < offered else None
        if capped == self._capped.get(pool):
            return
        self._capped[pool] = capped
        if capped is not None:
            log.warning(
                "pool %s: its live nodes offer %d slots (this node %d: -c), but the pool's "
                "workers caps the attempts running at once at %d across all nodes; raise "
                "workers in PIPELINE_POOLS, or leave it out to use every slot offered",
                pool,
                offered,
                self.slots,
                cap,
            )

    def _loop(self) -> None:
        wake_keys = [self.keys.wake(p) for p in self.pools]
        block: float | None = None
        self._waiting = ThreadConnection.of(node_client(self.store.client, wake_keys[0])).get()
        while not self._stop.is_set():
            try:
                if self._beat_first:  # Redis came back: was its state lost?
                    self._heartbeat()
                    self._beat_first = False
                quiet = self._quiet_until - time.monotonic()
                if quiet > 0:  # a loss of state: the calls of vanished holders end first
                    block = None
                    self._stop.wait(min(quiet, MAX_IDLE_S))
                    self._heartbeat()
                    continue
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
                        block = wait  # the next tick waits for the doorbell itself (one trip)
                    else:
                        self.store.client.blpop(wake_keys, timeout=wait)
            except Exception as exc:  # noqa: BLE001 - the loop must survive Redis outages
                if self._stop.is_set():
                    break  # a fused wait cut short by stop()
                log.warning("dispatcher tick failed: %s", exc)
                block = None
                self._beat_first = True
                self._stop.wait(0.5)

    def controlled(self) -> list[tuple[Controlled, set[str]]]:
        """The gates whose limit a controller moves (``adaptive-concurrency``), each once, with
        the pools whose queues pass it. Without the dispatcher's lock, which a tick holds
        through its doorbell wait (up to a second): a reload replaces both dicts whole."""
        gates, settings = self.gates, self.settings
        found: dict[int, tuple[Controlled, set[str]]] = {}
        for name, gate in list(gates.items()):
            q = settings.queues.get(name)
            if q is None:
                continue
            for g in walk(gate):
                if isinstance(g, Controlled):
                    found.setdefault(id(g), (g, set()))[1].add(q.worker_pool_id)
        return list(found.values())

    def control(self) -> None:
        """Ask each adaptive gate to close its window (one node a window moves the limit); a
        limit that rose rings its pools' doorbells, so the free room is dispatched now."""
        for gate, pools in self.controlled():
            try:
                raised = gate.control()
            except Exception as exc:  # noqa: BLE001 - the next tick tries again; logged once
                problem = f"{type(exc).__name__}: {exc}"
                if self._control_problem.get(id(gate)) != problem:
                    log.warning("adaptive gate %s: controller failed: %s", gate.name, problem)
                self._control_problem[id(gate)] = problem
                continue
            self._control_problem.pop(id(gate), None)
            for pool in pools if raised else ():
                store = self.store.for_pool(pool)
                store.client.rpush(store.keys.wake(pool), "1")

    def _control_loop(self) -> None:
        while not self._stop.wait(CONTROL_TICK_S):
            if self.controlled():
                self.control()

    def fused(self) -> bool:
        """Whether the doorbell wait and its tick go in one round trip (docs/internals.md)."""
        return (
            len(self.pools) == 1
            and not self.ingesting
            and not self.foreign
            and all(static_budget(g) for g in self.gates.values())
        )

    def tick(self, block: float | None = None) -> float | None:
        """Dispatch every pool once; returns when the earliest known event is due (monotonic).
        ``block`` (s): first wait that long for the doorbell, in the same round trip."""
        with self._lock:
            events = [self._tick_pool(pool, queues, block) for pool, queues in self.pools.items()]
            now = time.monotonic()
            if self.foreign and now >= self._foreign_due:
                # other pools' queues when one of their events is due, not at every ring
                due = now + MAX_IDLE_S
                for q in self.foreign:
                    res = self.store.for_pool(q.worker_pool_id).tick(q, [q], 0.0, 0, 0)
                    metrics.deadline_expired(q, res.expired[q.queue_name])
                    if res.next_event is not None:
                        due = min(due, now + res.next_event)
                self._foreign_due = due
            if self.foreign:
                events.append(self._foreign_due)
            return min((e for e in events if e is not None), default=None)

    def _queue_tick(self, pool: str, q: QueueConfig) -> QueueTick:
        gate = self.gates[q.queue_name]
        cap = gate.capacity()
        specs = self.specs[q.queue_name]
        # look ahead past the slots (or a quota key's limit) once per node of the pool, so each
        # node hands released slots over locally; once in all behind a composite of per-key
        # quotas and a slot gate, whose parked attempts hold quota slots (docs/internals.md)
        nodes = self.pool_nodes[pool]
        per = 1 if cap is not None and specs else nodes
        ahead_cap = -1
        if cap is not None:
            ahead = self.settings.lookahead_for(cap) * per
            if gate.per_node:
                cap *= nodes
            if specs:  # past a quota key only while the slot gate has room (dispatch.lua, 4.)
                ahead_cap = cap
            cap += ahead
        if per > 1:
            specs = tuple(dataclasses.replace(s, lookahead=s.lookahead * per) for s in specs)
        return self.store.queue_tick(
            q,
            budget=dispatch_budget(gate),
            cap=-1 if cap is None else cap,
            ahead_cap=ahead_cap,
            lane=self.settings.merge_policy.lane(q.labels),
            specs=specs,
            tokens=self.tokens[q.queue_name],
            rand=self.rng.random(),
        )

    def _tick_pool(self, pool: str, queues: list[QueueConfig], block: float | None) -> float | None:
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
            doorbell=self.keys.wake(pool),  # emptied: the rings so far wake no redundant tick
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
            if any(e.budget < 1.0 for e in entries):
                # a fractional budget moved a share of the free room: more may fit now
                return time.monotonic()
        # else the next move needs an event: a ring, or a due retry or deadline (next_event)
        return None if res.next_event is None else time.monotonic() + res.next_event

    def _ingest(self, q: QueueConfig) -> None:
        """Take what a reference producer wrote into the queue's sorted set (a failure is
        retried on the next tick)."""
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
        except Exception as exc:  # noqa: BLE001 - put them back; the lease would also do it
            log.error("could not send %d request(s) to Celery: %s", len(moved), exc)
            for d in moved:
                note = entry("requeued", reason="could not send to Celery")
                self.store.requeue(d.id, d.token, delay=1.0, attempted=False, note=note)

    def _reap_retired(self) -> None:
        """Free expired reservations of gates a reload replaced; forget one that holds none."""
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

    def reap(self) -> int:
        """Requeue attempts whose lease expired and free their gate reservations."""
        with self._lock:
            n = sum(self._reap_queue(q) for qs in self.pools.values() for q in qs)
            self._reap_retired()
            return n

    def _reap_queue(self, q: QueueConfig) -> int:
        gate = self.gates[q.queue_name]
        reaped = self.store.reap(q.queue_name)
        for rid, token in reaped:
            gate.release(make_holder(rid, token))
            log.warning(
                "reaped request %s attempt %s on %s (lease expired)", rid, token, q.queue_name
            )
            metrics.count(metrics.series().reclaims, q, "attempt")
            tracing.reenqueue_span(
                rid,
                token,
                "lease expired",
                queue_name=q.queue_name,
                noted=partial(self.store.attempt_span, rid, token),
            )
        for h in gate.reap():
            log.warning("gate %s freed expired reservation %s", q.queue_name, h)
            metrics.count(metrics.series().reclaims, q, "gate")
        if self.specs[q.queue_name] or self.tokens[q.queue_name]:
            # tenants held back by a quota key whose wake-up was lost get another look
            sched.recheck(self.store.scripts, self.keys, q.queue_name)
        self.check_wedge(q.queue_name, gate)
        return len(reaped)

    def check_wedge(self, queue: str, gate: Gate) -> bool:
        """Wedged: requests wait, the gate is full and nothing finished for ``wedge_after_s``
        (server clock); log the holders and record it (``Keys.wedged``)."""
        cap = gate.capacity()
        if cap is not None and gate.per_node:
            cap *= self.pool_nodes[self.settings.queues[queue].worker_pool_id]
        c = self.store.client
        # the queue's slot's server (on a cluster its primary: a cluster pipeline sends no TIME),
        # whose clock also scored the recent set
        with node_client(c, self.keys.pending(queue)).pipeline(transaction=False) as p:
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
