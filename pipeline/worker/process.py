"""Per-process worker state: one :class:`Runtime` per process (a store, the gates bound to
Redis, the release bell, a heartbeat thread renewing the leases of live attempts), created
lazily and again after a fork. It starts attempts (fenced by their token, with the gate's
acquire in the same round trip when it can) and releases reservations — idempotently, retried,
and handed straight to a parked attempt of this process when the gate allows.

Config reloads: the node's main process applies a reload to its runtime
(:meth:`Runtime.apply`) and writes the accepted queues and pools to a snapshot file
(``PIPELINE_CONFIG_SNAPSHOT``, set before the pool forks); a prefork child compares the file
with the one it last read (one ``stat``) when an attempt begins, and applies it when it moved.
An attempt keeps the gate it acquired until it releases; one not yet admitted asks the
current gate."""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings, from_snapshot, load_settings, to_snapshot
from ..gates import (
    AcquireContext,
    Decision,
    Gate,
    GateEnv,
    PreparedAcquire,
    PreparedRelease,
    attempt_gate,
    check_gates,
    same_attempt_gate,
)
from ..http.call import reset_tls
from ..observability import tracing
from ..store import ScriptCall, Store, run_batch
from ..store import holder as make_holder
from ..store.journal import entry
from .attempt import Attempt
from .bell import ReleaseBell, Ticket
from .endpoints import check_endpoints
from .release import ReleasePlan

log = logging.getLogger("pipeline.worker")

RELEASE_TRIES = 4
SNAPSHOT_ENV = "PIPELINE_CONFIG_SNAPSHOT"  # the node's accepted queue config, for its children


class Runtime:
    """Per-process worker state."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = check_gates(settings or load_settings())
        check_endpoints(self.settings)  # a queue's API key variable is set, its TLS files load
        self.store = Store(self.settings)
        self.env = GateEnv(self.store.client, self.store.keys, node=_node_name())
        self._gates: dict[str, Gate] = {}
        self._pool_gates: dict[str, Gate | None] = {}
        self._live: dict[str, Attempt] = {}  # holder -> its attempt (renewed on its gate)
        self._lock = threading.RLock()
        self._snapshot: tuple[int, int, int] | None = None  # the snapshot applied, if any
        self._heartbeat: threading.Thread | None = None
        self._stopping = threading.Event()
        self.rng = random.Random()
        self.bell = ReleaseBell(self.store.client, self.store.keys.freed_channel())

    # -- gates ---------------------------------------------------------------------------
    def gate(self, queue: str) -> Gate:
        with self._lock:
            gate = self._gates.get(queue)
            if gate is None:
                gate = attempt_gate(self.settings, queue, self.env, self._pool_gates)
                self._gates[queue] = gate
            return gate

    def current_gate(self, queue: str) -> Gate | None:
        """The queue's gate under the current config; None for a queue it no longer has."""
        return self.gate(queue) if queue in self.settings.queues else None

    def apply(self, settings: Settings) -> None:
        """Switch to reloaded settings (validated by the caller). Gates configured as before
        stay; a changed one is built anew on first use. Attempts keep the gate they hold."""
        with self._lock:
            old, self.settings = self.settings, settings
            for name in list(self._gates):
                if not same_attempt_gate(old, settings, name):
                    del self._gates[name]
            for pool in list(self._pool_gates):
                if old.pool_configs.get(pool) != settings.pool_configs.get(pool):
                    del self._pool_gates[pool]
        reset_tls()  # new connections load the TLS files again (a rotated certificate)

    def follow_snapshot(self) -> bool:
        """Apply the node's config snapshot if it moved since this process last read it (a
        prefork child learning of a reload); True when it applied one."""
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
        """Write this runtime's queues and pools for the node's other processes (the main
        process, after a reload it accepted)."""
        path = os.environ.get(SNAPSHOT_ENV)
        if not path:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(to_snapshot(self.settings), fh)
        os.replace(tmp, path)
        self._snapshot = _snapshot_stamp()

    def release(
        self,
        queue: str,
        request_id: str,
        token: str,
        *,
        hand_over: bool = False,
        gate: Gate | None = None,
        wake: Sequence[str] = (),
    ) -> bool:
        """Release a holder's reservation: idempotent, retried, logged when it fails. The
        queue's bell rings, and so do the ``wake`` bells (the quota keys the holder held a
        slot of), for attempts of this process parked on them.

        ``gate``: the gate the holder acquired (an attempt's own, which a config reload may
        since have replaced); default: the queue's current gate.

        ``hand_over`` (the holder does hold a slot of a ``hands_over`` gate): when an attempt
        of this process is parked for one of that gate (the queue's current one), the slot
        goes straight to it — it is woken at once, admitted, and heads for the server while
        this thread records the transfer. True when the slot was handed over (nothing was
        freed: the finish / requeue that follows publishes no release)."""
        plan = self.plan_release(
            queue, request_id, token, hand_over=hand_over, gate=gate, wake=wake, batch=False
        )
        return plan.handed_over

    def plan_release(
        self,
        queue: str,
        request_id: str,
        token: str,
        *,
        hand_over: bool = False,
        gate: Gate | None = None,
        wake: Sequence[str] = (),
        batch: bool = True,
    ) -> ReleasePlan:
        """:meth:`release`, with the gate's script call left for :meth:`release_then` to send
        ahead of the attempt's finish / requeue in the same round trip (``batch``, when the
        gate's release or transfer is script calls: ``Gate.prepare_release`` /
        ``Gate.prepare_transfer``); otherwise done here, as :meth:`release` does."""
        holder = make_holder(request_id, token)
        with self._lock:
            self._live.pop(holder, None)
        current = self.current_gate(queue)
        gate = gate or current
        plan = ReleasePlan(queue, holder, gate, tuple(wake))
        if gate is None:
            return plan
        # a hand-over is recorded with the gate's limit and the taker leaves for the server at
        # once: only on the current gate, never one a reload replaced (its stale limit could
        # refuse the transfer of a slot already given)
        bell = gate.handover_bell(queue, wake) if hand_over and gate is current else None
        if bell is not None:
            ticket = self.bell.hand_over(bell, gate)
            if ticket is not None:
                plan.ticket, plan.bell = ticket, bell
                plan.wake = tuple(k for k in wake if k != bell)  # quota slots a transfer frees
                plan.prepared = _prepared(gate.prepare_transfer, holder, ticket.ctx, batch)
                if plan.prepared is None:
                    self._transfer(gate, holder, ticket)
                    for key in plan.wake:
                        self.bell.ring(key, echo=True)
                return plan
        plan.prepared = _prepared(gate.prepare_release, holder, None, batch)
        if plan.prepared is None:
            self._release_now(gate, holder, queue, wake)
        return plan

    def release_then(self, plan: ReleasePlan, call: ScriptCall) -> Any:
        """The plan's gate call (if any) and then ``call`` (the attempt's finish / requeue),
        in one round trip, each atomic and in that order: the reservation is released (or
        handed over) before the request leaves the attempt. Returns ``call``'s reply (raises
        its error). A failed gate call is retried the usual way (:meth:`release`)."""
        prepared = plan.prepared
        if prepared is None:
            return call.script(keys=call.keys, args=call.args)
        # the finish / requeue publishes the release: the direct rings below expect its echo
        for name in self._ringing(plan):
            self.bell.expect_echo(name)
        if call.script.replication is not None:
            # a call that waits for replicas (its WAIT follows it): the gate calls go first
            self._settle(plan, run_batch(self.store.client, list(prepared.calls)))
            return call.script(keys=call.keys, args=call.args)
        try:
            *gate_replies, reply = run_batch(self.store.client, [*prepared.calls, call])
        except Exception as exc:
            self._settle(plan, exc)
            raise
        self._settle(plan, gate_replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def parked_ahead(self, bell: str, gate: Gate) -> bool:
        """Whether this process still has at least half the dispatcher's look-ahead past
        ``gate``'s capacity behind ``bell`` (``Settings.lookahead_for`` of
        ``Gate.handover_capacity``: a slot gate's, on the queue's bell; a per-key quota's
        limit, on the key's, ``Gate.handover_keyed``) parked on that bell: then a finish that
        handed its slot over there does not ring the pool's doorbell (the dispatcher is rung
        when the parked attempts run low, and tops them up in one tick, instead of one tick per
        finish; a quota key's held tenants are woken at the same point, see
        ``Keys.quota_blocked``)."""
        cap = gate.handover_capacity()
        if cap is None:
            return False
        keyed = gate.handover_keyed()
        behind = not keyed and bool(gate.quota_specs())
        need = -(-self.settings.lookahead_for(cap, quota_key=keyed, behind_quota=behind) // 2)
        return need > 0 and self.bell.waiting(bell) >= need

    @staticmethod
    def _ringing(plan: ReleasePlan) -> tuple[str, ...]:
        """The bells a plan's release rings (and the finish / requeue publishes)."""
        return plan.wake if plan.handed_over else (plan.queue, *plan.wake)

    def _settle(self, plan: ReleasePlan, replies: list[Any] | Exception) -> None:
        """Take the prepared gate calls' replies (or the error that lost them all): record a
        hand-over's outcome, or retry a failed release (all of it: releases are idempotent);
        then ring this process's bells."""
        assert plan.gate is not None and plan.prepared is not None
        gate, ticket = plan.gate, plan.ticket
        error = replies if isinstance(replies, Exception) else _first_error(replies)
        got = [] if isinstance(replies, Exception) else replies
        if ticket is not None:
            if error is not None:
                log.warning("hand-over of %s on gate %s failed: %s", plan.holder, gate.name, error)
                self._transfer(gate, plan.holder, ticket)
            else:
                try:
                    ticket.held = plan.prepared.done(got)
                    if not ticket.held:
                        _lapsed(plan.holder, ticket, gate)
                finally:
                    ticket.transferred.set()
        else:
            try:
                if error is not None:
                    raise error
                plan.prepared.done(got)
            except Exception as exc:  # noqa: BLE001 - a release must never be silently lost
                log.warning("release of %s on gate %s failed: %s", plan.holder, plan.queue, exc)
                self._release_now(gate, plan.holder, plan.queue, (), ring=False)
        for name in self._ringing(plan):
            self.bell.ring(name)

    def _release_now(
        self, gate: Gate, holder: str, queue: str, wake: Sequence[str], *, ring: bool = True
    ) -> None:
        """Release on ``gate``, retried; then (``ring``) ring this process's bells."""
        for i in range(RELEASE_TRIES):
            try:
                gate.release(holder)
                if ring:
                    # the finish / requeue that follows publishes the release to other
                    # processes
                    self.bell.ring(queue, echo=True)
                    for key in wake:
                        self.bell.ring(key, echo=True)
                return
            except Exception as exc:  # noqa: BLE001 - a release must never be silently lost
                log.warning(
                    "release of %s on gate %s failed (try %d/%d): %s",
                    holder,
                    queue,
                    i + 1,
                    RELEASE_TRIES,
                    exc,
                )
                time.sleep(0.1 * 2**i)
        log.error("release of %s on gate %s gave up; its lease will expire", holder, queue)

    def _transfer(self, gate: Gate, giver: str, ticket: Ticket) -> None:
        """Record in Redis that ``giver``'s slot now belongs to the ticket's attempt (already
        on its way to the server); retried like a release. On failure the giver's lease
        lapses (it is no longer renewed) and the taker holds nothing to release."""
        try:
            for i in range(RELEASE_TRIES):
                try:
                    ticket.held = gate.transfer(giver, ticket.ctx)
                    if not ticket.held:
                        _lapsed(giver, ticket, gate)
                    return
                except Exception as exc:  # noqa: BLE001 - as a release: never silently lost
                    log.warning(
                        "hand-over of %s on gate %s failed (try %d/%d): %s",
                        giver,
                        gate.name,
                        i + 1,
                        RELEASE_TRIES,
                        exc,
                    )
                    time.sleep(0.1 * 2**i)
            log.error("hand-over of %s on gate %s gave up; its lease will expire", giver, gate.name)
        finally:
            ticket.transferred.set()

    # -- heartbeat -----------------------------------------------------------------------
    def _track(self, attempt: Attempt) -> None:
        with self._lock:
            self._live[attempt.holder] = attempt
            if self._heartbeat is None or not self._heartbeat.is_alive():
                self._heartbeat = threading.Thread(
                    target=self._beat, name="pipeline-heartbeat", daemon=True
                )
                self._heartbeat.start()

    def _beat(self) -> None:
        period = max(0.05, self.settings.lease_s / 3.0)
        while not self._stopping.wait(period):
            with self._lock:
                live = list(self._live.values())
            if not live:
                continue
            try:
                self.store.renew([(a.id, a.token, a.queue.queue_name) for a in live])
                by_gate: dict[int, tuple[Gate, list[str]]] = {}
                for a in live:  # each on the gate it holds (or asks)
                    by_gate.setdefault(id(a.gate), (a.gate, []))[1].append(a.holder)
                for gate, holders in by_gate.values():
                    gate.renew(holders, self.settings.lease_s)
            except Exception as exc:  # noqa: BLE001 - keep beating; leases tolerate a miss
                log.warning("lease renewal failed: %s", exc)

    def live_holders(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return [(a.id, a.token, a.queue.queue_name) for a in self._live.values()]

    # -- attempts ------------------------------------------------------------------------
    def begin(
        self,
        request_id: str,
        token: str,
        worker: str,
        queue: str | None = None,
        tenant: Mapping[str, str] | None = None,
    ) -> Attempt | None:
        """Start an attempt (fenced by ``token``); None for a stale message. When the queue's
        gate can (``Gate.prepare_acquire``; a per-key quota when the dispatcher named the
        request's ``tenant`` in its message), its acquire goes to Redis in the same round trip
        as the start, and the attempt begins with that decision; when others of this process
        are parked on the bell it would park on, it parks behind them without asking the gate
        for what they wait for (:meth:`behind_parked`)."""
        self.follow_snapshot()
        queue = queue if queue in self.settings.queues else self._queue_of(request_id)
        plan = self._prepare_acquire(queue, request_id, token, worker, tenant or {})
        decision = plan.decision
        took = False
        if plan.prepared is None:
            started = self.store.start(request_id, token, queue or "", worker)
        else:
            start = self.store.start_call(request_id, token, queue or "", worker)
            reply, *acquired = run_batch(self.store.client, [start, *plan.prepared.calls])
            error = _first_error(acquired)
            # (a call that failed may have been preceded by one that took: give back all)
            took = error is not None or plan.prepared.took(acquired)
            started = None if isinstance(reply, Exception) else self.store.started(reply)
            if started is None:
                if took:  # the start failed or was fenced off: give the new slots back
                    self.release(queue or "", request_id, token, gate=plan.gate)
                if isinstance(reply, Exception):
                    raise reply
                return None
            if error is not None:  # the attempt asks its gate again
                log.warning("gate %s failed for %s: %s", queue, request_id, error)
            else:
                decision = plan.prepared.decide(acquired)
        if started is None:
            return None
        record = started.record
        try:
            attempt = Attempt(self, record, token, worker, started.clock_offset)
        except (KeyError, ValueError, TypeError) as exc:
            # a record this worker cannot read (written by hand, or corrupted): end it
            message = f"unreadable request record: {type(exc).__name__}: {exc}"
            log.error("request %s: %s", request_id, message)
            if took or (decision is not None and decision.admitted):
                self.release(queue or "", request_id, token, gate=plan.gate)
            self.store.finish(
                request_id,
                token,
                attempted=False,
                status_code=None,
                payload=json.dumps({"error": message}),
                error_code="INVALID_REQUEST",
                error_message=message,
            )
            return None
        if tenant and any(attempt.metadata.get(k) != v for k, v in tenant.items()):
            # the dispatcher's tenant is not the record's (it never is): ask the gate anew
            if took:
                self.release(queue or "", request_id, token, gate=plan.gate)
            decision = None
        if decision is not None and plan.gate is not None:
            attempt.gate = plan.gate  # the gate that decided, even if a reload replaced it
            attempt.decision = decision
            attempt._generation = plan.generation
            attempt._key_generations.update(plan.key_generations)
            parks_here = decision.bell(queue or "") == plan.bell
            attempt.behind = plan.waiting if parks_here and not decision.admitted else 0
        self._track(attempt)
        return attempt

    def behind_parked(
        self, bell: str, gate: Gate, ctx: AcquireContext | None = None
    ) -> tuple[Decision, int] | None:
        """An attempt that starts while others of this process are parked on its gate's
        hand-over ``bell`` (the queue's for a slot gate, the tenant's key for a per-key quota)
        parks behind them without asking the gate for what they wait for: the gate's
        :meth:`~pipeline.gates.Gate.parked_decision` (with the request's ``ctx``:
        :meth:`~pipeline.gates.Gate.acquire_behind`) and how many are parked, or None (ask).
        The caller reads the bell's generation first."""
        waiting = self._waiting(bell)
        if waiting == 0:
            return None
        decision = gate.parked_decision(bell) if ctx is None else gate.acquire_behind(ctx, bell)
        return None if decision is None else (decision, waiting)

    def _waiting(self, bell: str) -> int:
        """Attempts of this process parked on ``bell`` (0 when parking is off)."""
        return self.bell.waiting(bell) if self.settings.park_s > 0 else 0

    def _prepare_acquire(
        self,
        queue: str | None,
        request_id: str,
        token: str,
        worker: str,
        tenant: Mapping[str, str],
    ) -> StartPlan:
        """How an attempt's start asks its gate: the gate's acquire as script calls (none
        when the gate has none), with the generations of the bells it may park on read before
        them (see ``Attempt._park``); or, when others of this process are parked on the bell
        it would park on (``Gate.start_bell``), the gate's parked decision without a call, or
        calls for the rest of the gate only (a composite's quotas)."""
        name = queue or ""
        gate = self.current_gate(name)
        if gate is None:
            return StartPlan(None, None)
        plan = StartPlan(gate, None, generation=self.bell.generation(name))
        plan.bell = gate.start_bell(name, tenant)
        behind = None
        if plan.bell is not None:
            if plan.bell != name:
                plan.key_generations[plan.bell] = self.bell.generation(plan.bell)
            plan.waiting = self._waiting(plan.bell)
            if plan.waiting > 0:
                plan.decision = gate.parked_decision(plan.bell)
                if plan.decision is not None:
                    return plan
                behind = plan.bell
        holder = make_holder(request_id, token)
        try:
            plan.prepared = gate.prepare_acquire(
                holder, worker, self.settings.lease_s, tenant, behind
            )
        except Exception as exc:  # noqa: BLE001 - the attempt asks its gate the usual way
            log.warning("gate %s could not prepare for %s: %s", queue, request_id, exc)
        return plan

    def _queue_of(self, request_id: str) -> str:
        queue = self.store.client.hget(self.store.keys.request(request_id), "queue")
        return str(queue or "")

    def abandon(
        self, request_id: str, token: str, queue: str | None, *, cancel: bool, reason: str
    ) -> None:
        """An attempt ended without reporting (hard time limit, killed child, revoke,
        shutdown): release its reservation and requeue or cancel its request. Fenced and
        idempotent: a no-op when the attempt already finished."""
        queue = queue or self._queue_of(request_id)
        self.release(queue, request_id, token)
        done: object
        if cancel:
            done = None is not self.store.finish(
                request_id,
                token,
                attempted=False,
                status_code=None,
                payload=json.dumps({"error": "cancelled"}),
                error_code="CANCELLED",
                error_message=reason,
            )
        else:
            done = self.store.requeue(
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
            if not cancel and tracing.enabled():
                # the span's context: this process's, or (a pool child's, after a hard time
                # limit or a lost child) the one the attempt left in its record
                tracing.reenqueue_span(
                    request_id,
                    token,
                    reason,
                    queue_name=queue,
                    traceparent=self.store.attempt_span(request_id, token),
                )

    def stop(self) -> None:
        self._stopping.set()
        self.bell.stop()


def _prepared(
    prepare: Callable[..., PreparedRelease | None], holder: str, ctx: Any, batch: bool
) -> PreparedRelease | None:
    """A gate's prepared release (``ctx`` None) or transfer; None when not batching, when the
    gate has none, or when preparing it failed (then it is done the usual way)."""
    if not batch:
        return None
    try:
        return prepare(holder) if ctx is None else prepare(holder, ctx)
    except Exception as exc:  # noqa: BLE001 - the release is done directly instead
        log.warning("could not prepare the release of %s: %s", holder, exc)
        return None


@dataclass
class StartPlan:
    """How :meth:`Runtime.begin` asks the gate (:meth:`Runtime._prepare_acquire`): the gate
    (None: the queue has none), its prepared calls, or a decision taken without a call (parked
    behind others); the generations of the queue's bell and of the key bell it may park on
    (read first), the bell others may be parked on (``Gate.start_bell``) and how many were."""

    gate: Gate | None
    decision: Decision | None
    prepared: PreparedAcquire | None = None
    generation: int = 0
    key_generations: dict[str, int] = field(default_factory=dict)
    bell: str | None = None
    waiting: int = 0


def _first_error(replies: Sequence[Any]) -> Exception | None:
    return next((r for r in replies if isinstance(r, Exception)), None)


def _lapsed(giver: str, ticket: Ticket, gate: Gate) -> None:
    log.warning(
        "slot of %s handed to %s on gate %s, but its lease had lapsed and the gate is full",
        giver,
        ticket.ctx.holder,
        gate.name,
    )


def _snapshot_stamp() -> tuple[int, int, int] | None:
    """(inode, mtime ns, size) of the node's config snapshot; None when there is none."""
    path = os.environ.get(SNAPSHOT_ENV)
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def read_snapshot(base: Settings) -> Settings:
    """``base`` with the queues and pools of the node's config snapshot."""
    path = os.environ[SNAPSHOT_ENV]
    with open(path, encoding="utf-8") as fh:
        data: Any = json.load(fh)
    return from_snapshot(base, data, path)


def node_settings() -> Settings:
    """A new process's settings: the node's accepted config when a reload wrote one (so a
    child forked after a reload — or after a rejected edit of the files — runs what the node
    runs), else the environment and the files."""
    if _snapshot_stamp() is None:
        return load_settings()
    base = {k: v for k, v in os.environ.items() if k not in ("PIPELINE_QUEUES", "PIPELINE_POOLS")}
    try:
        return read_snapshot(load_settings(base))
    except Exception as exc:  # noqa: BLE001 - the files, as at start, rather than nothing
        log.error("cannot read the node's config snapshot, using the files: %s", exc)
        return load_settings()


def _node_name() -> str:
    return os.environ.get("PIPELINE_NODE") or f"{os.uname().nodename}.{os.getpid()}"


_runtimes: dict[int, Runtime] = {}
_runtime_lock = threading.Lock()
_settings_override: Settings | None = None


def use_settings(settings: Settings | None) -> None:
    """Make new runtimes use ``settings`` instead of the environment (tests, embedding)."""
    global _settings_override
    with _runtime_lock:
        _settings_override = settings
        for rt in _runtimes.values():
            rt.stop()
        _runtimes.clear()


def runtime() -> Runtime:
    """This process's runtime (a new one after a fork)."""
    pid = os.getpid()
    with _runtime_lock:
        rt = _runtimes.get(pid)
        if rt is None:
            _runtimes.clear()
            if _settings_override is not None:
                rt = Runtime(_settings_override)
            else:
                stamp = _snapshot_stamp()  # before reading: a newer file is followed later
                rt = Runtime(node_settings())
                rt._snapshot = stamp
            _runtimes[pid] = rt
        return rt
