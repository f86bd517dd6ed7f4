"""What an attempt's release turned into before its finish / requeue goes to Redis (see
:meth:`pipeline.worker.process.Runtime.plan_release`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..gates import Gate, PreparedRelease
from .bell import Ticket


@dataclass
class ReleasePlan:
    """An attempt's release as :meth:`Runtime.plan_release` left it: whether its slot was
    handed over (to ``ticket``'s attempt, parked on ``bell``), and the gate call still to send
    ahead of the finish / requeue (``prepared``; None: done already). ``wake``: the bells the
    release rings besides the queue's."""

    queue: str
    holder: str
    gate: Gate | None
    wake: tuple[str, ...] = ()
    ticket: Ticket | None = None
    bell: str | None = None  # the bell whose parked attempt took the slot (handed over)
    prepared: PreparedRelease | None = None

    @property
    def handed_over(self) -> bool:
        return self.bell is not None
