"""Hand-overs within one process: a done holder gives its slot straight to an attempt of its
process parked for one (the taker's ``Ticket``) instead of a release and a new acquire, and
the bells a release rings. What a :class:`~.reservation.Reservation` asks of them, for its
queue (docs/internals.md, "Slot hand-over")."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from ..config import Settings
from ..gates import Calls, Gate, HandsOver
from .bell import ReleaseBell, Ticket

log = logging.getLogger("pipeline.worker")

TRANSFER_WAIT_S = 10.0  # a taker of a handed-over slot waits this long for the transfer record


class Handover(NamedTuple):
    """What a release tells the finish / requeue its round trip ends with (``release_with``'s
    ``build``): whether the slot went to an attempt of this process parked for one (no
    release is published), and, with it, whether enough of the dispatcher's look-ahead is
    still parked there that the pool's doorbell need not ring either."""

    handed_over: bool = False
    nowake: bool = False


NOT_HANDED = Handover()


class Process(Protocol):
    """What hand-overs use of their process's runtime (``Runtime``)."""

    settings: Settings
    bell: ReleaseBell

    def current_gate(self, queue: str) -> Gate | None: ...


class Handovers:
    """The hand-overs of one queue's slots in this process, as one reservation sees them."""

    def __init__(self, host: Process, queue: str) -> None:
        self.host = host
        self.queue = queue

    def bells(self, gate: Gate, metadata: Mapping[str, str]) -> tuple[str, ...]:
        """Where a holder with ``metadata`` hands over (and a taker parks to be handed to)."""
        return gate.handover_bells(self.queue, metadata) if isinstance(gate, HandsOver) else ()

    def taker(self, gate: Gate, metadata: Mapping[str, str], sure: bool) -> Ticket | None:
        """The granted ticket of an attempt parked on the first hand-over bell that has one
        (``ticket.bell``), or None. Never on a gate a reload replaced: its stale limit could
        refuse the transfer. ``sure``: the giver's lease is surely alive (``ticket.sure``)."""
        if not isinstance(gate, HandsOver) or gate is not self.host.current_gate(self.queue):
            return None
        return self.host.bell.hand_over(gate.handover_bells(self.queue, metadata), gate, sure)

    @staticmethod
    def refused(gate: Gate, ticket: Ticket) -> bool:
        """The taker's side: whether Redis refused the transfer. The taker goes on at once only
        when the giver's lease was surely alive (proven within half the guard's budget:
        ``ticket.sure``) and the gate's limit does not move; else once Redis recorded the
        transfer as taken (the giver's finish round trip, a millisecond): a giver's lease may
        have lapsed and its slot gone to another node (a process stopped or cut off past its
        lease), a moving limit may have fallen below in-flight. Sending first would put one
        call more than the limit at the server (issue 48)."""
        if ticket.sure and not getattr(gate, "handover_may_fail", False):
            return False
        ticket.transferred.wait(TRANSFER_WAIT_S)
        return not ticket.held

    @staticmethod
    def held(ticket: Ticket) -> bool:
        """Whether the slot handed with ``ticket`` is the taker's: it waits for its giver's
        transfer record (releasing before it would leave a lease nobody renews)."""
        ticket.transferred.wait(TRANSFER_WAIT_S)
        return ticket.held

    @staticmethod
    def step(gate: Gate, giver: str, ticket: Ticket) -> Calls[bool]:
        """The transfer of ``giver``'s slot to the taker, as calls for the finish's round trip."""
        assert isinstance(gate, HandsOver)
        return gate.transfer_calls(giver, ticket.ctx, ticket.bell)

    def transfer(self, gate: Gate, giver: str, ticket: Ticket) -> None:
        """The transfer, directly (its calls did not go, or failed)."""
        self.record(gate, giver, ticket, self.step(gate, giver, ticket).run())

    @staticmethod
    def record(gate: Gate, giver: str, ticket: Ticket | None, done: bool) -> None:
        """Note on the taker's ticket whether the transfer took the slot for it."""
        if ticket is None:
            return
        ticket.held = done
        if not done and getattr(gate, "handover_may_fail", False):
            log.info(
                "slot of %s not handed to %s on gate %s: its limit is below its in-flight",
                giver,
                ticket.ctx.holder,
                gate.name,
            )
        elif not done:
            log.warning(
                "slot of %s handed to %s on gate %s, but its lease had lapsed and the gate is full",
                giver,
                ticket.ctx.holder,
                gate.name,
            )

    def rings(self, bells: Sequence[str], held: bool, handed: str | None) -> list[str]:
        """The bells a release rings (``bells``: its wake keys); after a hand-over on
        ``handed``, the other keys only."""
        if handed is not None:
            return [n for n in bells if n != handed]
        return [self.queue, *bells] if held else [self.queue]

    def ring(self, names: Sequence[str], *, echo: bool) -> None:
        for name in names:
            self.host.bell.ring(name, echo=echo)

    def expect_echoes(self, names: Sequence[str]) -> None:
        """The finish / requeue publishes the release: its echo is expected on ``names``."""
        for name in names:
            self.host.bell.expect_echo(name)

    def parked_ahead(self, gate: Gate, name: str | None) -> bool:
        """At least half the dispatcher's look-ahead still parked on bell ``name``: a finish
        that handed over there need not ring the doorbell (docs/internals.md)."""
        if name is None:
            return False
        keyed = name != self.queue
        specs = gate.quota_specs()
        cap = min(s.limit for s in specs) if keyed and specs else gate.capacity()
        if cap is None:
            return False
        need = -(-self.host.settings.lookahead_for(cap) // 2)
        return need > 0 and self.host.bell.waiting(name) >= need
