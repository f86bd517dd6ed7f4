"""A gate reservation, from the attempt's first ask to its one release: every exit path releases
through :meth:`Reservation.release_with` (the finish / requeue's round trip) or
:meth:`Reservation.release`, and :meth:`Reservation.close` is the attempt's one exit
(docs/architecture.md#where-a-reservation-is-released). A slot may go straight to an attempt
of the process parked for one: :mod:`.handover`."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..config import Settings
from ..gates import (
    CONTINUE,
    AcquireContext,
    Admission,
    Batched,
    Calls,
    Decision,
    Gate,
    Observation,
    Observes,
    Verdict,
    settle,
    wake_keys,
    walk,
)
from ..store import ScriptCall, Store, run_batch
from .bell import ReleaseBell, Ticket
from .guard import LeaseGuard
from .handover import NOT_HANDED, Handover, Handovers

log = logging.getLogger("pipeline.worker")

RELEASE_TRIES = 4


class Host(Protocol):
    """What an attempt and its reservation use of their process's runtime (``Runtime``)."""

    settings: Settings
    store: Store
    bell: ReleaseBell
    rng: random.Random
    guard: LeaseGuard

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
        self.handovers = Handovers(host, queue)  # its slot to (or from) a parked attempt
        self.ctx: AcquireContext | None = None  # the request, once its record is read
        self.bells: list[str] = []  # quota keys it may park on and rings when it releases
        self.decision: Decision | None = None  # the gate's last answer
        self.ticket: Ticket | None = None  # the slot came by hand-over from this process
        self.generations: dict[str, int] = {}  # bells' generations, read before the last ask
        self.behind = 0  # attempts it parked behind at the start without asking; 0: it asked
        self._start_bell: str | None = None  # the bell others were parked on at the start
        self._released = False  # a release went out (or was tried) since its last take
        self._freed = False  # and the gate took it (or the hand-over): none is needed again
        # when its leases were last proven (monotonic): the send time of its start (made
        # before it) or of the last renewal Redis took (Runtime._renew); the lease guard's count
        self.proof = time.monotonic()
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
        name = next(iter(self.handovers.bells(gate, tenant)), None)
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
        offer = self.ctx if name in self.handovers.bells(self.gate, self.ctx.metadata) else None
        ticket = self.host.bell.park(
            name, generation, timeout, offer, self.gate, rid=self.ctx.request_id
        )
        if ticket is not None and ticket.granted and self.handovers.refused(self.gate, ticket):
            ticket.granted, ticket.rang = False, True  # as a ring: it asks again
        elif ticket is not None and ticket.granted:
            self.ticket, self.decision = ticket, CONTINUE
            self._released = self._freed = False
        return ticket

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
        rings = self.handovers.rings(self.bells, self._held(), None)
        self._retried(None)
        self.handovers.ring(rings, echo=False)

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
        handovers = self.handovers
        if ticket is None:
            handover = NOT_HANDED
        else:
            handover = Handover(True, handovers.parked_ahead(self.gate, bell))
        rings = handovers.rings(self.bells, held, bell)
        try:
            call = build(handover)
        except Exception:  # the finish / requeue could not be built: released all the same
            self._complete(None, ticket, [])
            handovers.ring(rings, echo=False)
            raise
        if step is None or not step.calls:  # not as calls: done here, before the round trip
            _observe_alone(seen, self.holder)
            self._complete(step, ticket, [])
            handovers.ring(rings, echo=ticket is None)  # the finish / requeue publishes one
            return call()
        if ticket is None:  # the finish / requeue publishes the release: expect its echo
            handovers.expect_echoes(rings)
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
        handovers.ring(rings, echo=False)
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
            return self.handovers.held(self.ticket)
        return self.decision is not None and self.decision.admitted

    def _settle(self, served: int | None, prompt: int | None) -> None:
        """Settle a token charge (a failure leaves the estimate, only logged)."""
        try:
            assert self.ctx is not None
            settle(self.gate, self.ctx, served, prompt)
        except Exception as exc:  # noqa: BLE001 - never in the way of the release
            log.warning("settling the token charge of %s failed: %s", self.holder, exc)

    def _taker(self) -> Ticket | None:
        assert self.ctx is not None
        sure = self.host.guard.fresh(self.proof)  # its lease is alive: the transfer will go
        return self.handovers.taker(self.gate, self.ctx.metadata, sure)

    def _step(self, ticket: Ticket | None) -> Calls[bool] | None:
        gate = self.gate
        try:
            if ticket is not None:
                return self.handovers.step(gate, self.holder, ticket)
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
                    self.handovers.record(self.gate, self.holder, ticket, step.then(replies))
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
                    self.handovers.transfer(self.gate, self.holder, ticket)
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


def _observe_alone(calls: Sequence[ScriptCall], holder: str) -> None:
    for call in calls:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - an observation lost is only logged
            log.warning("observation of %s failed: %s", holder, exc)


def _first_error(replies: Sequence[Any]) -> Exception | None:
    return next((r for r in replies if isinstance(r, Exception)), None)
