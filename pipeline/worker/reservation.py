"""A gate reservation, from the attempt's first ask to its one release: every exit path releases
through :meth:`Reservation.release_with` (the finish / requeue's round trip) or
:meth:`Reservation.release` (docs/architecture.md#where-a-reservation-is-released)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from ..config import Settings
from ..gates import (
    CONTINUE,
    AcquireContext,
    Admission,
    Batched,
    Calls,
    Decision,
    Gate,
    HandsOver,
    Observation,
    Observes,
    Verdict,
    settle,
    wake_keys,
    walk,
)
from ..store import ScriptCall, Store, run_batch
from .bell import ReleaseBell, Ticket

log = logging.getLogger("pipeline.worker")

RELEASE_TRIES = 4
TRANSFER_WAIT_S = 10.0  # a taker of a handed-over slot waits this long for the transfer record


class Handover(NamedTuple):
    """What a release tells the finish / requeue its round trip ends with (``release_with``'s
    ``build``): whether the slot went to an attempt of this process parked for one (no
    release is published), and, with it, whether enough of the dispatcher's look-ahead is
    still parked there that the pool's doorbell need not ring either."""

    handed_over: bool = False
    nowake: bool = False


NOT_HANDED = Handover()


class Host(Protocol):
    """What an attempt and its reservation use of their process's runtime (``Runtime``)."""

    settings: Settings
    store: Store
    bell: ReleaseBell
    rng: random.Random

    def gate(self, queue: str) -> Gate: ...

    def current_gate(self, queue: str) -> Gate | None: ...

    def untrack(self, holder: str) -> None: ...


class Reservation:
    """One attempt's claim on its gate; once admitted it keeps that gate until it releases."""

    def __init__(self, host: Host, queue: str, holder: str, gate: Gate) -> None:
        self.host = host
        self.queue = queue
        self.holder = holder
        self.gate = gate
        self.ctx: AcquireContext | None = None  # the request, once its record is read
        self.bells: list[str] = []  # quota keys it may park on and rings when it releases
        self.decision: Decision | None = None  # the gate's last answer
        self.ticket: Ticket | None = None  # the slot came by hand-over from this process
        self.generations: dict[str, int] = {}  # bells' generations, read before the last ask
        self.behind = 0  # attempts it parked behind at the start without asking; 0: it asked
        self._start_bell: str | None = None  # the bell others were parked on at the start
        self._released = False  # a release went out (or was tried) since its last take
        self._freed = False  # and the gate took it (or the hand-over): none is needed again
        # what the attempt's HTTP call showed, for the gates that learn from answers: sent
        # with the release (release_with), then forgotten
        self.observation: Observation | None = None

    def bind(self, ctx: AcquireContext) -> None:
        self.ctx = ctx
        self.bells = wake_keys(self.gate, ctx.metadata)

    def start_calls(
        self, worker: str, tenant: Mapping[str, str], priority: int | None = None
    ) -> Calls[Admission] | None:
        """The acquire to send with the attempt's start, when the gate is ``Batched``; behind
        attempts of this process parked on its hand-over bell, a refusal without asking."""
        gate, bell = self.gate, self.host.bell
        self.generations = {self.queue: bell.generation(self.queue)}
        name = next(iter(self._handover_bells(tenant)), None)
        waiting = 0
        if name is not None:
            self.generations.setdefault(name, bell.generation(name))
            waiting = bell.waiting(name) if self.host.settings.park_s > 0 else 0
        if not isinstance(gate, Batched):
            return None
        try:
            calls = gate.acquire_calls(
                self.holder,
                worker,
                self.host.settings.lease_s,
                tenant,
                waiting > 0,
                priority=priority,
            )
        except Exception as exc:  # noqa: BLE001 - the attempt asks its gate the usual way
            log.warning("gate %s could not prepare for %s: %s", self.queue, self.holder, exc)
            return None
        self.behind, self._start_bell = waiting, name
        return calls

    def started(self, calls: Calls[Admission], replies: Sequence[Any]) -> bool:
        """Take the start's acquire replies (one failed: no decision, it asks again); whether
        they took a reservation (to give back if the start was fenced off)."""
        error = _first_error(replies)
        if error is not None:
            log.warning("gate %s failed for %s: %s", self.queue, self.holder, error)
            self.behind = 0
            return True  # a call that failed may follow one that took: give back all
        self.decision, took = calls.then(replies)
        if self.decision.admitted or self.decision.bell(self.queue) != self._start_bell:
            self.behind = 0  # (a composite's quota refused it first: it parks on the key)
        return took

    def ask(self) -> Decision:
        bell = self.host.bell
        self.generations = {name: bell.generation(name) for name in (self.queue, *self.bells)}
        assert self.ctx is not None
        try:
            self.decision = self.gate.acquire(self.ctx)
        except Exception as exc:  # noqa: BLE001 - a gate error refuses, it never crashes
            log.warning("gate %s failed for %s: %s", self.queue, self.holder, exc)
            self.decision = Decision(Verdict.REFUSE, reason="error")
        self._released = self._freed = False
        return self.decision

    def wait(self, decision: Decision, timeout: float) -> Ticket | None:
        """Park once on ``decision``'s bell (None: it rang already, or closed); on the hand-over
        bell a holder of this process may hand it its slot (``ticket.granted``)."""
        assert self.ctx is not None
        name = decision.bell(self.queue)
        generation = self.generations.get(name, self.generations.get(self.queue, 0))
        offer = self.ctx if name in self._handover_bells(self.ctx.metadata) else None
        ticket = self.host.bell.park(
            name, generation, timeout, offer, self.gate, rid=self.ctx.request_id
        )
        if ticket is not None and ticket.granted and self._refused_transfer(ticket):
            ticket.granted, ticket.rang = False, True  # as a ring: it asks again
        elif ticket is not None and ticket.granted:
            self.ticket, self.decision = ticket, CONTINUE
            self._released = self._freed = False
        return ticket

    def _refused_transfer(self, ticket: Ticket) -> bool:
        """A gate whose limit moves may refuse a hand-over although its giver held the slot
        (the limit fell below in-flight): the taker goes on only once the transfer is
        recorded as taken (the giver's finish round trip, a millisecond)."""
        if not getattr(self.gate, "handover_may_fail", False):
            return False
        ticket.transferred.wait(TRANSFER_WAIT_S)
        return not ticket.held

    def _handover_bells(self, metadata: Mapping[str, str]) -> tuple[str, ...]:
        gate = self.gate
        return gate.handover_bells(self.queue, metadata) if isinstance(gate, HandsOver) else ()

    def follow(self, gate: Gate) -> None:
        """Ask ``gate`` from now on (a reload replaced the queue's); a parked attempt's own
        quota slots on the old one are given back."""
        try:
            self.gate.release(self.holder)
        except Exception as exc:  # noqa: BLE001 - the lease is the safety net
            log.warning("release of %s on a replaced gate failed: %s", self.holder, exc)
        self.gate = gate
        if self.ctx is not None:
            self.bind(self.ctx)

    @property
    def admitted(self) -> bool:
        return self.ticket is not None or (self.decision is not None and self.decision.admitted)

    def close(self) -> None:
        """The attempt's one exit (``InferenceTask.run``'s ``finally``): release unless a release
        went out since its last take — normally its finish / requeue's, so a no-op."""
        if not self._released:
            self.release()

    def release(self) -> None:
        """Release now, retried (an attempt that ends without its finish / requeue)."""
        self.host.untrack(self.holder)
        rings = self._rings(self._held(), None)
        self._retried(None)
        self._ring(rings, echo=False)

    def discard(self) -> None:
        """Give back what the start's acquire took (the dispatcher's tenant was not the
        request's) and forget its decision."""
        self._retried(None)
        self.decision = None
        self._released = self._freed = False

    def release_with(
        self,
        build: Callable[[Handover], ScriptCall],
        served: int | None = 0,
        prompt: int | None = None,
    ) -> Any:
        """Settle a token charge to ``served`` (``prompt``: the answer's prompt tokens),
        release (or hand the slot to an attempt of this process parked for one), then the
        finish / requeue ``build(Handover(...))`` returns, in one round trip, the gate's
        step first. Returns (or raises) its reply. Released already (a finish tried again,
        or ended after the exit's release): the finish / requeue alone."""
        self.host.untrack(self.holder)
        if self._freed:
            return build(NOT_HANDED)()
        held = self._held()
        if held:
            self._settle(served, prompt)
        ticket = self._taker() if held else None
        bell = ticket.bell if ticket is not None else None  # where its taker parked
        seen = self._observations(held)  # before the release: the observation reads its lease
        step = self._step(ticket)
        handover = NOT_HANDED if ticket is None else Handover(True, self._parked_ahead(bell))
        rings = self._rings(held, bell)
        try:
            call = build(handover)
        except Exception:  # the finish / requeue could not be built: released all the same
            self._complete(None, ticket, [])
            self._ring(rings, echo=False)
            raise
        if step is None or not step.calls:  # not as calls: done here, before the round trip
            _observe_alone(seen, self.holder)
            self._complete(step, ticket, [])
            self._ring(rings, echo=ticket is None)  # the finish / requeue publishes a release
            return call()
        if ticket is None:  # the finish / requeue publishes the release: expect its echo
            for name in rings:
                self.host.bell.expect_echo(name)
        replies: list[Any] | Exception
        n = len(seen)
        try:
            *replies, reply = run_batch(self.host.store.client, [*seen, *step.calls, call])
            if (error := _first_error(replies[:n])) is not None:
                log.warning("observation of %s failed: %s", self.holder, error)
            replies = replies[n:]
        except Exception as exc:  # noqa: BLE001 - the gate's step is done; the error is the call's
            replies = reply = exc
        self._complete(step, ticket, replies)
        self._ring(rings, echo=False)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _observations(self, held: bool) -> list[ScriptCall]:
        """The observation calls of the gates that learn from answers, for what the attempt's
        HTTP call showed (none when it holds nothing: it was not sent under the gate)."""
        observation, self.observation = self.observation, None
        if observation is None or not held:
            return []
        try:
            return [
                c for g in walk(self.gate) if isinstance(g, Observes)
                for c in g.observe_calls(self.holder, observation)
            ]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the release goes on without it
            log.warning("could not prepare the observation of %s: %s", self.holder, exc)
            return []

    def _held(self) -> bool:
        """Whether it holds a slot, marking it released. A taker waits for its giver's
        transfer record: releasing before it would leave a lease nobody renews."""
        if self._released:
            return False
        self._released = True
        if self.ticket is not None:
            self.ticket.transferred.wait(TRANSFER_WAIT_S)
            return self.ticket.held
        return self.decision is not None and self.decision.admitted

    def _settle(self, served: int | None, prompt: int | None) -> None:
        """Settle a token charge (a failure leaves the estimate, only logged)."""
        try:
            assert self.ctx is not None
            settle(self.gate, self.ctx, served, prompt)
        except Exception as exc:  # noqa: BLE001 - never in the way of the release
            log.warning("settling the token charge of %s failed: %s", self.holder, exc)

    def _taker(self) -> Ticket | None:
        """The granted ticket of an attempt parked on the first hand-over bell that has one
        (``ticket.bell``), or None. Never on a gate a reload replaced: its stale limit could
        refuse the transfer."""
        gate = self.gate
        if not isinstance(gate, HandsOver) or gate is not self.host.current_gate(self.queue):
            return None
        assert self.ctx is not None
        return self.host.bell.hand_over(gate.handover_bells(self.queue, self.ctx.metadata), gate)

    def _step(self, ticket: Ticket | None) -> Calls[bool] | None:
        gate = self.gate
        try:
            if ticket is not None and isinstance(gate, HandsOver):
                return gate.transfer_calls(self.holder, ticket.ctx, ticket.bell)
            return gate.release_calls(self.holder) if isinstance(gate, Batched) else None
        except Exception as exc:  # noqa: BLE001 - done directly instead
            log.warning("could not prepare the release of %s: %s", self.holder, exc)
            return None

    def _complete(
        self, step: Calls[bool] | None, ticket: Ticket | None, replies: list[Any] | Exception
    ) -> None:
        """Take the gate step's replies; one that failed or did not go is done directly."""
        try:
            if step is not None:
                error = replies if isinstance(replies, Exception) else _first_error(replies)
                if error is None:
                    assert not isinstance(replies, Exception)
                    self._record(ticket, step.then(replies))
                    self._freed = True
                    return
                log.warning(
                    "release of %s on gate %s failed: %s", self.holder, self.gate.name, error
                )
            self._retried(ticket)
        except Exception as exc:  # noqa: BLE001 - a release must never be silently lost
            log.warning("release of %s on gate %s failed: %s", self.holder, self.gate.name, exc)
            self._retried(ticket)
        finally:
            if ticket is not None:
                ticket.transferred.set()

    def _retried(self, ticket: Ticket | None) -> None:
        """Release (or transfer to ``ticket``) directly, retried; then leave it to lapse."""
        what = "release" if ticket is None else "hand-over"
        for i in range(RELEASE_TRIES):
            try:
                if ticket is None:
                    self.gate.release(self.holder)
                else:
                    assert isinstance(self.gate, HandsOver)
                    calls = self.gate.transfer_calls(self.holder, ticket.ctx, ticket.bell)
                    self._record(ticket, calls.run())
                self._freed = True
                return
            except Exception as exc:  # noqa: BLE001 - a release must never be silently lost
                log.warning(
                    "%s of %s on gate %s failed (try %d/%d): %s",
                    what,
                    self.holder,
                    self.gate.name,
                    i + 1,
                    RELEASE_TRIES,
                    exc,
                )
                time.sleep(0.1 * 2**i)
        log.error(
            "%s of %s on gate %s gave up; its lease will expire", what, self.holder, self.gate.name
        )

    def _record(self, ticket: Ticket | None, done: bool) -> None:
        if ticket is None:
            return
        ticket.held = done
        if not done and getattr(self.gate, "handover_may_fail", False):
            log.info(
                "slot of %s not handed to %s on gate %s: its limit is below its in-flight",
                self.holder,
                ticket.ctx.holder,
                self.gate.name,
            )
        elif not done:
            log.warning(
                "slot of %s handed to %s on gate %s, but its lease had lapsed and the gate is full",
                self.holder,
                ticket.ctx.holder,
                self.gate.name,
            )

    def _rings(self, held: bool, handed: str | None) -> list[str]:
        """The bells its release rings; after a hand-over on ``handed``, the other keys only."""
        if handed is not None:
            return [n for n in self.bells if n != handed]
        return [self.queue, *self.bells] if held else [self.queue]

    def _ring(self, names: Sequence[str], *, echo: bool) -> None:
        for name in names:
            self.host.bell.ring(name, echo=echo)

    def _parked_ahead(self, name: str | None) -> bool:
        """At least half the dispatcher's look-ahead still parked on bell ``name``: a finish
        that handed over there need not ring the doorbell (docs/internals.md)."""
        if name is None:
            return False
        gate, keyed = self.gate, name != self.queue
        specs = gate.quota_specs()
        cap = min(s.limit for s in specs) if keyed and specs else gate.capacity()
        if cap is None:
            return False
        need = -(-self.host.settings.lookahead_for(cap) // 2)
        return need > 0 and self.host.bell.waiting(name) >= need


def _observe_alone(calls: Sequence[ScriptCall], holder: str) -> None:
    for call in calls:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - an observation lost is only logged
            log.warning("observation of %s failed: %s", holder, exc)


def _first_error(replies: Sequence[Any]) -> Exception | None:
    return next((r for r in replies if isinstance(r, Exception)), None)
