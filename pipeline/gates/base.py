"""The gate protocol: a small core every gate has, and opt-in capabilities.

**Core** (:class:`Gate`). :meth:`~Gate.acquire` answers a :class:`Decision`: Continue (the
holder now has a reservation to release), Refuse (no reservation; the request goes back to its
queue), Wait (no reservation; park and ask again until capacity frees or the wait times out),
or Drop (terminal result). A reservation belongs to a *holder*, ``"<request id>:<attempt
token>"``; :meth:`~Gate.release` is idempotent and a no-op for a holder that holds nothing, so
every exit path may call it. Reservations kept in Redis are leases, renewed by the attempt's
heartbeat (:meth:`~Gate.renew`) and freed by the reaper (:meth:`~Gate.reap`) when the holder
dies; every expiry is judged by the Redis server's clock. :meth:`~Gate.capacity` is the most
reservations it grants at once (``per_node``: on each worker node); the dispatcher counts its
attempts against it. A gate made of others (a composite, a wrapper) names them in
:meth:`~Gate.parts`, and the core's defaults fan out to them (a gate of no parts: no-ops).

**Capabilities**, each a class a gate derives from (checked with ``isinstance``):

- :class:`Budgeted`: admission follows a reading (a metric, a key another system writes, a
  planner's lease); the dispatcher scales the worker slots it fills by it
  (:func:`dispatch_budget`).
- :class:`Batched`: acquire and release as script calls (:class:`Calls`) the worker sends in
  the round trip of the attempt's start and of its finish / requeue.
- :class:`HandsOver`: a reservation is one interchangeable slot, which a holder that is done
  hands straight to an attempt of its process parked for one.
- :class:`Settles`: admission charges an estimate that the attempt settles when it ends (a
  token budget; :func:`settle`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import redis

from ..store.keys import Keys
from ..store.sched import QuotaSpec
from ..store.scripts import ScriptCall


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
    # a Refuse that a release of this gate's own reservations can end (a full slot pool, not
    # a closed metric): the attempt may park for a release instead of going back to the queue
    wake_on_release: bool = False
    # the release bell to park on for such a Refuse: None for the queue's (a slot gate), a
    # quota key for a per-key quota (published when a request of that key leaves)
    wake_key: str | None = None
    # for a Refuse: how long (s) the request should wait before it asks again, when the gate
    # knows (a token budget: until enough of its window has expired); None: the usual jitter
    retry_after: float | None = None
    # for a Drop without a result of the gate's own: why (the GATE_DROPPED error_message)
    message: str = ""
    # the type of the gate that decided, inside a composite or wrapper (for the request's
    # decision log; '' for the gate that was asked)
    gate: str = ""

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.CONTINUE

    def bell(self, queue: str) -> str:
        """The release bell an attempt of ``queue`` parks on for this decision: its per-key
        quota's key, else the queue's."""
        return self.wake_key or queue


CONTINUE = Decision(Verdict.CONTINUE)


@dataclass(frozen=True)
class AcquireContext:
    """Everything a gate may look at when admitting one attempt."""

    request_id: str
    token: str
    queue: str
    worker: str
    lease_s: float  # how long the reservation lasts unless renewed (s, server clock)
    deadline: float  # Unix s
    metadata: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    payload: str = ""  # the request's JSON body as it will be sent (a token budget reads it)

    @property
    def holder(self) -> str:
        return f"{self.request_id}:{self.token}"


@dataclass(frozen=True)
class GateEnv:
    """Runtime resources a gate binds to (absent while only validating a config)."""

    client: redis.Redis
    keys: Keys
    node: str = "local"


T = TypeVar("T")
Admission = tuple[Decision, bool]  # an acquire's decision, and whether it took a reservation


@dataclass(frozen=True)
class Calls(Generic[T]):
    """A gate step as script calls on the pipeline's Redis, for the worker to send in the round
    trip of an attempt's start or finish: ``calls`` run in order (each atomic), then ``then``
    turns their replies (none of them an error) into the step's result, doing what the calls
    could not (e.g. a release of a holder on another node)."""

    calls: tuple[ScriptCall, ...]
    then: Callable[[Sequence[Any]], T]

    def run(self) -> T:
        """The step on its own, a call at a time."""
        return self.then([call() for call in self.calls])

    @staticmethod
    def join(parts: Sequence[Calls[Any]], then: Callable[[list[Any]], T]) -> Calls[T]:
        """Several steps as one, their calls in ``parts``' order; ``then`` gets each part's
        result."""

        def done(replies: Sequence[Any]) -> T:
            out, at = [], 0
            for p in parts:
                out.append(p.then(replies[at : at + len(p.calls)]))
                at += len(p.calls)
            return then(out)

        return Calls(tuple(c for p in parts for c in p.calls), done)


class Gate:
    """The core every gate has; see the module. A gate of no :meth:`parts` holds nothing and
    counts nothing unless it overrides these."""

    type_name: ClassVar[str] = ""
    # capacity() applies to each worker node separately (the dispatcher multiplies it by the
    # live nodes); a gate made of others follows the part that sets its capacity
    per_node: bool = False

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        self.name = name
        self.params = params
        self.env = env

    def parts(self) -> Sequence[Gate]:
        """The gates this one is made of (a composite's, a wrapper's inner gate)."""
        return ()

    def acquire(self, ctx: AcquireContext) -> Decision:
        return CONTINUE

    def release(self, holder: str) -> bool:
        """Free ``holder``'s reservation (every part's, last first). Idempotent; True if one
        was freed."""
        freed = False
        for gate in reversed(self.parts()):
            freed = gate.release(holder) or freed
        return freed

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        """Extend the leases of live holders to ``lease_s`` from now (server clock)."""
        listed = list(holders)
        for gate in self.parts():
            gate.renew(listed, lease_s)

    def reap(self) -> list[str]:
        """Free reservations whose lease expired (server clock); returns their holders."""
        return list(dict.fromkeys(h for gate in self.parts() for h in gate.reap()))

    def capacity(self) -> int | None:
        """Most reservations this gate grants at once, or None when it does not count."""
        caps = [c for c in (g.capacity() for g in self.parts()) if c is not None]
        return min(caps) if caps else None

    def budget(self) -> float:
        """Free share of capacity in [0, 1], for status and metrics. Never raises. The
        dispatcher's is :func:`dispatch_budget`."""
        return min((g.budget() for g in self.parts()), default=1.0)

    def quota_specs(self) -> list[QuotaSpec]:
        """The blocking per-key concurrency quotas in this gate: the dispatcher counts each
        key's requests against them and holds a tenant at its limit back, instead of sending
        attempts the gate must refuse (``lookahead`` is left 0: the dispatcher sets it)."""
        return [s for gate in self.parts() for s in gate.quota_specs()]

    def holders(self) -> list[dict[str, Any]]:
        """Live reservations: request id, attempt token, worker, age (s), lease expiry (a
        holder of several parts once, the first part's entry)."""
        seen: dict[tuple[str, str], dict[str, Any]] = {}
        for gate in self.parts():
            for entry in gate.holders():
                seen.setdefault((entry["request_id"], entry["attempt"]), entry)
        return list(seen.values())

    def in_flight(self) -> int:
        """Holders with a live reservation (0 iff nothing leaks)."""
        return len(self.holders())

    def describe(self) -> dict[str, Any]:
        return {
            "type": self.type_name,
            "limit": self.capacity(),
            "in_flight": self.in_flight(),
            "holders": self.holders(),
        }

    def close(self) -> None:
        """Release client resources (HTTP sessions); reservations are untouched."""
        for gate in self.parts():
            gate.close()


class Budgeted(Gate):
    """Capability: admission follows a reading — :meth:`budget`, which the dispatcher scales
    the worker slots it fills by (:func:`dispatch_budget`). Acquire refuses while it is 0 and
    holds nothing."""

    def budget(self) -> float:
        raise NotImplementedError

    def acquire(self, ctx: AcquireContext) -> Decision:
        if self.budget() <= 0.0:
            return Decision(Verdict.REFUSE, reason="gate_closed")
        return CONTINUE


class Batched(Gate):
    """Capability: the acquire and the release as script calls on the pipeline's Redis, which
    the worker sends in the same round trip as the attempt's start and as its finish /
    requeue."""

    def acquire_calls(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str],
        behind: bool = False,
    ) -> Calls[Admission] | None:
        """The acquire, needing nothing of the request but its holder, worker and ``tenant``
        (the metadata attribute the dispatcher named in its message, ``{attribute: value}``).
        ``behind``: attempts of this process are parked on the gate's hand-over bell
        (:class:`HandsOver`): the attempt is told the slot they wait for is full without
        asking for it (it parks behind them; a slot freed rings that bell, so it goes to
        them first anyway). None: not as calls (the attempt calls :meth:`acquire`)."""
        raise NotImplementedError

    def release_calls(self, holder: str) -> Calls[bool] | None:
        """:meth:`release` as calls; None: release it directly."""
        raise NotImplementedError


class HandsOver(Gate):
    """Capability: a reservation is one interchangeable slot (a slot gate's, or a per-key
    quota's slot of one key). A holder of this process that is done hands it to an attempt of
    this process parked for one on the gate's hand-over bell; that attempt goes to the server
    at once, while the giver records the transfer (:meth:`transfer_calls`)."""

    def handover_bell(self, queue: str, metadata: Mapping[str, str]) -> str | None:
        """The bell a holder with ``metadata`` hands its slot over on (where an attempt refused
        for that slot parks): the queue's for a slot gate, the key's for a per-key quota; None
        when there is none (no value of the quota's attribute)."""
        raise NotImplementedError

    def transfer_calls(self, giver: str, ctx: AcquireContext) -> Calls[bool]:
        """Free ``giver``'s slot and take it for ``ctx.holder``, atomically: True when the
        taker now holds one (False: the giver's lease had lapsed and the gate is full)."""
        raise NotImplementedError


class Settles(Gate):
    """Capability: admission charges an estimate that the attempt settles when it ends."""

    def settle(self, ctx: AcquireContext, tokens: int | None) -> None:
        """Settle ``ctx``'s charge to ``tokens`` (what the request consumed: the response's
        usage), 0 when nothing was served (a refund), or None to keep the estimate (sent, but
        no answer said what was served). A no-op for a holder charged nothing."""
        raise NotImplementedError


def walk(gate: Gate) -> Iterator[Gate]:
    """``gate`` and every gate it is made of, depth first."""
    yield gate
    for part in gate.parts():
        yield from walk(part)


def dispatch_budget(gate: Gate) -> float:
    """The share (0..1) of free worker slots the dispatcher fills for ``gate``: the lowest
    reading of its :class:`Budgeted` gates, 1.0 when it has none (a slot gate's capacity the
    dispatcher counts itself). Never raises."""
    return min((g.budget() for g in walk(gate) if isinstance(g, Budgeted)), default=1.0)


def static_budget(gate: Gate) -> bool:
    """Whether :func:`dispatch_budget` never changes (no :class:`Budgeted` gate in it): the
    dispatcher may compute a tick's arguments before it blocks on its doorbell."""
    return not any(isinstance(g, Budgeted) for g in walk(gate))


def settle(gate: Gate, ctx: AcquireContext, tokens: int | None) -> None:
    """Settle ``ctx``'s charge on every :class:`Settles` gate in ``gate``."""
    for g in walk(gate):
        if isinstance(g, Settles):
            g.settle(ctx, tokens)


def per_key(gate: Gate) -> bool:
    """A per-key quota (a gate of no parts with quota specs): its slot is its tenant's."""
    return not gate.parts() and bool(gate.quota_specs())


def wake_keys(gate: Gate, metadata: Mapping[str, str]) -> list[str]:
    """The quota keys a request with ``metadata`` may park on besides its queue
    (``Decision.wake_key``), and rings when it releases a slot of them: one per per-key quota
    in ``gate`` (wrapped ones too) that the request has a value for."""
    return [
        spec.key_prefix + value
        for g in walk(gate)
        if per_key(g)
        for spec in g.quota_specs()
        if (value := metadata.get(spec.attribute))
    ]
