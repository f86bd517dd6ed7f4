"""The gate protocol: a small core every gate has (:class:`Gate`) and opt-in capabilities
(:class:`Budgeted`, :class:`Batched`, :class:`HandsOver`, :class:`Settles`); docs/gates.md
describes both."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import redis

from ..store.keys import Keys
from ..store.keys import holder as make_holder
from ..store.sched import QuotaSpec, TokenSpec
from ..store.scripts import ScriptCall

log = logging.getLogger("pipeline.gates")


class Verdict(enum.Enum):
    CONTINUE = "continue"
    REFUSE = "refuse"
    WAIT = "wait"
    DROP = "drop"


@dataclass(frozen=True)
class Decision:
    """What a gate decided for one acquire call."""

    verdict: Verdict
    reason: str = ""  # gate_closed | quota_exhausted | dropped | error (metrics label)
    labels: dict[str, str] = field(default_factory=dict)  # e.g. classification
    status_code: int | None = None  # for DROP: a result of the gate's own
    payload: str | None = None
    # a Refuse a release can end (a full slot pool, not a closed metric): the attempt may park
    wake_on_release: bool = False
    wake_key: str | None = None  # the bell to park on: None the queue's, else a quota key
    retry_after: float | None = None  # a Refuse: ask again after this long (s); None: jitter
    message: str = ""  # a Drop without a result of its own: the GATE_DROPPED message
    gate: str = ""  # the type of the inner gate that decided ('' for the gate asked)

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.CONTINUE

    def bell(self, queue: str) -> str:
        """The release bell an attempt of ``queue`` parks on for this decision."""
        return self.wake_key or queue


CONTINUE = Decision(Verdict.CONTINUE)


@dataclass(frozen=True)
class AcquireContext:
    request_id: str
    token: str
    queue: str
    worker: str
    lease_s: float  # how long the reservation lasts unless renewed (s, server clock)
    deadline: float  # Unix s
    metadata: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    payload: str = ""  # the request's JSON body as it will be sent (a token budget reads it)
    priority: int = 0  # the request's priority, 0-9 (an adaptive gate's bands read it)

    @property
    def holder(self) -> str:
        return make_holder(self.request_id, self.token)


@dataclass(frozen=True)
class GateEnv:
    """Runtime resources a gate binds to (None while only validating a config)."""

    client: redis.Redis
    keys: Keys
    node: str = "local"


T = TypeVar("T")
Admission = tuple[Decision, bool]  # an acquire's decision, and whether it took a reservation


@dataclass(frozen=True)
class Calls(Generic[T]):
    """A gate step as script calls the worker sends in the round trip of an attempt's start or
    finish; ``then`` turns their replies (none an error) into the step's result."""

    calls: tuple[ScriptCall, ...]
    then: Callable[[Sequence[Any]], T]

    def run(self) -> T:
        """The step on its own, a call at a time."""
        return self.then([call() for call in self.calls])

    @staticmethod
    def join(parts: Sequence[Calls[Any]], then: Callable[[list[Any]], T]) -> Calls[T]:
        """Several steps as one; ``then`` gets each part's result."""

        def done(replies: Sequence[Any]) -> T:
            out, at = [], 0
            for p in parts:
                out.append(p.then(replies[at : at + len(p.calls)]))
                at += len(p.calls)
            return then(out)

        return Calls(tuple(c for p in parts for c in p.calls), done)


class Gate:
    """The core every gate has; its defaults fan out to :meth:`parts`."""

    type_name: ClassVar[str] = ""
    per_node: bool = False  # capacity() is per worker node (the dispatcher multiplies it)

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        self.name = name
        self.params = params
        self.env = env

    def parts(self) -> Sequence[Gate]:
        return ()

    def acquire(self, ctx: AcquireContext) -> Decision:
        return CONTINUE

    def release(self, holder: str) -> bool:
        """Free ``holder``'s reservation (every part's, last first). Idempotent."""
        freed = False
        for gate in reversed(self.parts()):
            freed = gate.release(holder) or freed
        return freed

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        listed = list(holders)
        for gate in self.parts():
            gate.renew(listed, lease_s)

    def reap(self) -> list[str]:
        """Free reservations whose lease expired; returns their holders."""
        return list(dict.fromkeys(h for gate in self.parts() for h in gate.reap()))

    def capacity(self) -> int | None:
        """Most reservations this gate grants at once, or None when it does not count."""
        caps = [c for c in (g.capacity() for g in self.parts()) if c is not None]
        return min(caps) if caps else None

    def budget(self) -> float:
        """Free share in [0, 1], for status (the dispatcher's: :func:`dispatch_budget`)."""
        return min((g.budget() for g in self.parts()), default=1.0)

    def quota_specs(self) -> list[QuotaSpec]:
        """The blocking per-key quotas the dispatcher counts each key's requests against."""
        return [s for gate in self.parts() for s in gate.quota_specs()]

    def token_specs(self) -> list[TokenSpec]:
        """The blocking token budgets the dispatcher holds a tenant back by (and charges)."""
        return [s for gate in self.parts() for s in gate.token_specs()]

    def holders(self) -> list[dict[str, Any]]:
        """Live reservations (a holder of several parts once)."""
        seen: dict[tuple[str, str], dict[str, Any]] = {}
        for gate in self.parts():
            for entry in gate.holders():
                seen.setdefault((entry["request_id"], entry["attempt"]), entry)
        return list(seen.values())

    def in_flight(self) -> int:
        return len(self.holders())

    def describe(self) -> dict[str, Any]:
        return {
            "type": self.type_name,
            "limit": self.capacity(),
            "in_flight": self.in_flight(),
            "holders": self.holders(),
        }

    def close(self) -> None:
        """Close client resources; reservations are untouched."""
        for gate in self.parts():
            gate.close()


class Budgeted(Gate):
    """Capability: admission follows :meth:`budget`; acquire refuses at 0 and holds nothing."""

    def budget(self) -> float:
        raise NotImplementedError

    def acquire(self, ctx: AcquireContext) -> Decision:
        if self.budget() <= 0.0:
            return Decision(Verdict.REFUSE, reason="gate_closed")
        return CONTINUE


class Batched(Gate):
    """Capability: acquire and release as script calls (:class:`Calls`)."""

    def acquire_calls(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str],
        behind: bool = False,
        priority: int | None = None,
    ) -> Calls[Admission] | None:
        """The acquire, from the holder and the ``tenant`` (and ``priority``, None: unknown)
        the dispatcher named alone. ``behind``: attempts of this process are parked on the
        hand-over bell, so the slot is refused without asking (it parks behind them). None:
        call :meth:`acquire`."""
        raise NotImplementedError

    def release_calls(self, holder: str) -> Calls[bool] | None:
        """None: release it directly."""
        raise NotImplementedError


class HandsOver(Gate):
    """Capability: a reservation is one interchangeable slot, which a done holder hands to an
    attempt of its process parked for one."""

    # the transfer may be refused although the giver held its slot (a limit that moves): the
    # taker waits for it to be recorded before it goes on (see ``Reservation.wait``)
    handover_may_fail: bool = False

    def handover_bells(self, queue: str, metadata: Mapping[str, str]) -> tuple[str, ...]:
        """Where a holder with ``metadata`` hands over, in order (the first with an attempt
        parked there takes it): the queue, a quota key; none, nowhere. An attempt that starts
        while others of its process are parked on the first parks behind them."""
        raise NotImplementedError

    def transfer_calls(self, giver: str, ctx: AcquireContext, bell: str) -> Calls[bool]:
        """Free ``giver``'s slot and take it for ``ctx.holder`` atomically, ``ctx`` parked on
        ``bell`` (one of :meth:`handover_bells`); True when taken."""
        raise NotImplementedError


class Settles(Gate):
    """Capability: admission charges an estimate that the attempt settles when it ends."""

    def settle(self, ctx: AcquireContext, tokens: int | None, prompt: int | None = None) -> None:
        """Settle to ``tokens`` served (0 refunds), or None to keep the estimate; ``prompt``:
        the prompt tokens the answer's usage names, when it names them (what a learned
        estimate correction learns from)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Observation:
    """What one attempt's HTTP call showed of the server: ``kind`` ``ok`` (2xx), ``over`` (429,
    503, a gateway's rejected-saturated), ``ttl`` / ``evict`` (a gateway's drop reasons) or
    ``err`` (another 5xx, a transport error, a time-out); its latency (s) and a 2xx's
    completion tokens (0: its usage named none)."""

    kind: str
    latency_s: float
    tokens: int = 0
    retry_after_s: float | None = None
    retried: bool = False  # an earlier attempt of the request was retried


class Observes(Gate):
    """Capability: the gate learns from each answer; the observation goes in the round trip of
    the attempt's finish / requeue, before its release."""

    def observe_calls(self, holder: str, observation: Observation) -> Sequence[ScriptCall]:
        raise NotImplementedError


class Controlled(Gate):
    """Capability: the gate's limit is moved by a controller the dispatcher runs (one mover
    per window across the nodes, elected in Redis)."""

    def control(self) -> bool | None:
        """Close the current window if it is due and move the limit; True when it rose (wake
        what waits for it), False when it did not, None when no window was due."""
        raise NotImplementedError


def walk(gate: Gate) -> Iterator[Gate]:
    """``gate`` and every gate it is made of, depth first."""
    yield gate
    for part in gate.parts():
        yield from walk(part)


def dispatch_budget(gate: Gate) -> float:
    """The share of free worker slots the dispatcher fills: its lowest :class:`Budgeted`."""
    return min((g.budget() for g in walk(gate) if isinstance(g, Budgeted)), default=1.0)


def static_budget(gate: Gate) -> bool:
    """No :class:`Budgeted` part: a tick's arguments may be computed before its wait."""
    return not any(isinstance(g, Budgeted) for g in walk(gate))


def settle(gate: Gate, ctx: AcquireContext, tokens: int | None, prompt: int | None = None) -> None:
    """Settle ``ctx``'s charge on every :class:`Settles` gate in ``gate``."""
    for g in walk(gate):
        if isinstance(g, Settles):
            g.settle(ctx, tokens, prompt)


def per_key(gate: Gate) -> bool:
    """A per-key quota (a gate of no parts with quota specs): its slot is its tenant's."""
    return not gate.parts() and bool(gate.quota_specs())


def wake_keys(gate: Gate, metadata: Mapping[str, str]) -> list[str]:
    """The quota keys a request with ``metadata`` may park on and rings when it releases."""
    return [
        spec.key_prefix + value
        for g in walk(gate)
        if per_key(g)
        for spec in g.quota_specs()
        if (value := metadata.get(spec.attribute))
    ]


def note_problem(gate: Gate, old: str | None, problem: str | None, effect: str) -> str | None:
    """Log a gate's source ``problem`` when it starts or changes, and once when it heals."""
    if problem != old and problem is None:
        log.info("%s gate %s: source available again", gate.type_name, gate.name)
    elif problem != old:
        log.warning("%s gate %s: %s; %s", gate.type_name, gate.name, problem, effect)
    return problem
