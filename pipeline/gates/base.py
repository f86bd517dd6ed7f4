"""The gate protocol.

A gate answers two questions:

- :meth:`Gate.budget` → 0..1, how much of its capacity is free. The dispatcher moves
  ``floor(budget × free capacity)`` requests, so it never raises (errors read as the gate's
  fail-safe value).
  :meth:`Gate.dispatch_budget` is what the dispatcher actually uses (1.0 for a slot-counting
  gate, whose capacity the dispatcher counts itself).
- :meth:`Gate.acquire` → a :class:`Decision`: Continue (the holder now has a reservation to
  release), Refuse (no reservation; the request goes back to its queue), Wait (no reservation;
  park and ask again until capacity frees or the wait times out), or Drop (terminal result).

A reservation belongs to a *holder*, ``"<request id>:<attempt token>"``. :meth:`Gate.release`
is idempotent and a no-op for a holder that holds nothing, so every exit path may call it.
Reservations kept in Redis are leases: renewed by the attempt's heartbeat
(:meth:`Gate.renew`) and freed by the reaper (:meth:`Gate.reap`) when the holder dies.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

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
class PreparedAcquire:
    """A gate's acquire as :class:`ScriptCall` s (see :meth:`Gate.prepare_acquire`), run in
    order: ``decide`` turns their replies (none of them an error) into the decision, ``took``
    says whether they took a new reservation (one to give back if the attempt turns out
    stale)."""

    calls: tuple[ScriptCall, ...]
    decide: Callable[[Sequence[Any]], Decision]
    took: Callable[[Sequence[Any]], bool]

    @classmethod
    def one(
        cls, call: ScriptCall, decide: Callable[[Any], Decision], took: Callable[[Any], bool]
    ) -> PreparedAcquire:
        """An acquire that is one call; ``decide`` and ``took`` take its reply."""
        return cls((call,), lambda replies: decide(replies[0]), lambda replies: took(replies[0]))


@dataclass(frozen=True)
class PreparedRelease:
    """A gate's release or hand-over as :class:`ScriptCall` s (see :meth:`Gate.prepare_release`,
    :meth:`Gate.prepare_transfer`), for the worker to send in the same round trip as the
    attempt's finish / requeue, before it and in order: ``done`` turns the scripts' replies
    (none of them an error) into what :meth:`Gate.release` / :meth:`Gate.transfer` return (and
    finishes what the calls could not: a local gate's release of a holder that is not on this
    node)."""

    calls: tuple[ScriptCall, ...]
    done: Callable[[Sequence[Any]], bool]

    @classmethod
    def one(cls, call: ScriptCall, done: Callable[[Any], bool]) -> PreparedRelease:
        """A release or hand-over that is one call; ``done`` takes its reply."""
        return cls((call,), lambda replies: done(replies[0]))

    @classmethod
    def joined(
        cls, parts: Sequence[PreparedRelease], combine: Callable[[list[bool]], bool]
    ) -> PreparedRelease:
        """Several gates' prepared calls in one (in ``parts``' order): ``combine`` turns
        their ``done`` results into the whole's."""
        calls = tuple(c for p in parts for c in p.calls)

        def done(replies: Sequence[Any]) -> bool:
            return combine([p.done(r) for p, r in split_replies(parts, replies)])

        return cls(calls, done)


P = TypeVar("P", PreparedAcquire, PreparedRelease)


def split_replies(parts: Sequence[P], replies: Sequence[Any]) -> list[tuple[P, Sequence[Any]]]:
    """Each prepared part with its own replies, out of the replies of all their calls sent in
    order."""
    out, at = [], 0
    for p in parts:
        out.append((p, replies[at : at + len(p.calls)]))
        at += len(p.calls)
    return out


@dataclass(frozen=True)
class GateEnv:
    """Runtime resources a gate binds to (absent while only validating a config)."""

    client: redis.Redis
    keys: Keys
    node: str = "local"


class Gate:
    """Base class: an always-open gate with no reservations. Subclasses override.

    ``per_node`` is True when :meth:`capacity` applies to each worker node separately (the
    dispatcher multiplies it by the live nodes). Wrapper gates copy it from the inner gate that
    sets their capacity, on the instance.

    ``hands_over`` is True for a plain slot gate (``local-`` / ``global-max-concurrency``), a
    blocking concurrency quota (a slot of the holder's key) and a composite of such quotas
    followed by one slot gate: a holder of this process that is done with the server hands its
    slot to an attempt of this process parked for one (on :meth:`handover_bell`), which goes to
    the server without a Redis round trip (:meth:`transfer` records the new holder
    meanwhile).

    Leases are durations (``AcquireContext.lease_s``, :meth:`renew`): a gate's scripts judge
    every expiry by the Redis server's clock, never a node's.
    """

    type_name: ClassVar[str] = ""
    per_node: ClassVar[bool] = False
    # a reservation is one interchangeable slot, so a holder that is done may hand it straight
    # to an attempt parked for one (:meth:`transfer`) instead of releasing it
    hands_over: ClassVar[bool] = False
    # a per-key slot (a blocking concurrency quota): an attempt parked for another gate of a
    # composite keeps it (it is its tenant's, and released on every exit path like the rest)
    per_key: ClassVar[bool] = False
    # dispatch_budget() never changes (it reads nothing that moves): the dispatcher may compute
    # a tick's arguments before it blocks on its doorbell and send both in one round trip
    static_budget: ClassVar[bool] = False
    # it charges an estimate at admission that the attempt settles when it ends (a token
    # budget): the attempt calls :meth:`settle` before it releases
    settles: ClassVar[bool] = False

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        self.name = name
        self.params = params
        self.env = env

    # -- admission -----------------------------------------------------------------------
    def budget(self) -> float:
        """Free share of capacity in [0, 1]. Never raises."""
        return 1.0

    def dispatch_budget(self) -> float:
        """The budget the dispatcher scales free worker slots by. A slot-counting gate
        answers 1.0: the dispatcher counts its slots against :meth:`capacity` itself, and
        looks ahead past them (attempts park for a release). Never raises."""
        return self.budget()

    def capacity(self) -> int | None:
        """Most reservations this gate grants at once, or None when it does not count."""
        return None

    def handover_capacity(self) -> int | None:
        """How many reservations stand behind :meth:`handover_bell`: :meth:`capacity` for a
        slot gate, a key's limit for a per-key quota; None when they are not counted."""
        return self.capacity()

    def handover_keyed(self) -> bool:
        """Whether :meth:`handover_capacity` is a per-key quota's limit (the dispatcher's
        look-ahead past it is ``Settings.lookahead_for(..., quota_key=True)``)."""
        return False

    def quota_specs(self) -> list[QuotaSpec]:
        """The blocking per-key concurrency quotas in this gate (its own, or its inner
        gates'): the dispatcher counts each key's requests against them and holds a tenant
        at its limit back, instead of sending attempts the gate must refuse. ``lookahead`` is
        left 0 (the dispatcher sets it)."""
        return []

    def wake_keys(self, ctx: AcquireContext) -> list[str]:
        """The release bells (``Decision.wake_key``) a refusal of ``ctx`` may park on, besides
        its queue's: read before each acquire, so a release between a refusal and the park is
        never missed."""
        return []

    def acquire(self, ctx: AcquireContext) -> Decision:
        return CONTINUE

    def prepare_acquire(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str] | None = None,
        behind: str | None = None,
    ) -> PreparedAcquire | None:
        """The acquire as script calls that need nothing of the request but its holder,
        worker and ``tenant`` (the metadata attribute the dispatcher named in its message,
        ``{attribute: value}``), so the worker can send them in the same round trip as the
        attempt's start; ``behind``: others of this process are parked on that hand-over bell
        (:meth:`start_bell`): leave out what they wait for (a composite's slot gate: its
        :meth:`parked_decision` instead). None when the acquire is not such calls (the
        attempt calls :meth:`acquire`)."""
        return None

    def start_bell(self, queue: str, tenant: Mapping[str, str]) -> str | None:
        """The hand-over bell (:meth:`handover_bell`) an attempt of ``queue`` (of ``tenant``,
        as in :meth:`prepare_acquire`) would park on, known before its start: the queue's for
        a slot gate or a composite ending in one, the tenant's key for a per-key quota; None
        when not known."""
        bell = self.handover_bell(queue, ())
        return bell if bell == queue else None

    def acquire_behind(self, ctx: AcquireContext, bell: str) -> Decision | None:
        """An attempt's first ask when others of its process are parked on ``bell``, its
        :meth:`handover_bell`: the decision without asking the part of the gate those attempts
        wait for (:meth:`parked_decision`; a composite asks its per-key quotas first). None:
        ask the gate (:meth:`acquire`)."""
        return self.parked_decision(bell)

    def parked_decision(self, bell: str) -> Decision | None:
        """What an attempt that finds others of its process already parked on this gate's
        hand-over bell ``bell`` (:meth:`handover_bell`: the queue's for a slot gate, the
        tenant's key for a per-key quota) is told without asking Redis: a full slot gate's
        Refuse (or Wait), a key's quota exhausted. Sound for a gate whose every slot freed
        rings that bell: the slot went to an attempt parked before, which comes first anyway
        (dispatched earlier); the newcomer parks behind them and takes its turn. None (the
        default): ask the gate."""
        return None

    # -- reservations --------------------------------------------------------------------
    def release(self, holder: str) -> bool:
        """Free ``holder``'s reservation. Idempotent; returns True if one was freed."""
        return False

    def prepare_release(self, holder: str) -> PreparedRelease | None:
        """:meth:`release` as one script call, to send ahead of the attempt's finish / requeue
        in one round trip; None when the release is not one such call (it is called
        directly)."""
        return None

    def prepare_transfer(self, giver: str, ctx: AcquireContext) -> PreparedRelease | None:
        """:meth:`transfer` as one script call (see :meth:`prepare_release`); None when it is
        not one."""
        return None

    def settle(self, ctx: AcquireContext, tokens: int | None) -> None:
        """Settle the charge ``ctx``'s admission took (gates with ``settles``) when its
        attempt ends: to ``tokens``, what the request consumed (the response's usage), 0 when
        nothing was served (a refund), or None to keep the estimate (sent, but no answer said
        what was served). A no-op for a holder charged nothing (or whose charge expired)."""

    def handover_bell(self, queue: str, wake: Sequence[str]) -> str | None:
        """The bell whose parked attempts a holder of this gate may hand its reservation to
        (see ``hands_over``): the queue's for a slot gate; None when it hands nothing over.
        ``wake``: the holder's :meth:`wake_keys`."""
        return queue if self.hands_over else None

    def transfer(self, giver: str, ctx: AcquireContext) -> bool:
        """Hand ``giver``'s reservation to ``ctx.holder`` in one atomic step (see
        ``hands_over``); True when the taker now holds one. Only gates with ``hands_over``."""
        raise NotImplementedError(f"{self.type_name} gates do not hand reservations over")

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        """Extend the leases of live holders to ``lease_s`` from now (server clock)."""

    def reap(self) -> list[str]:
        """Free reservations whose lease expired (server clock); returns their holders."""
        return []

    def in_flight(self) -> int:
        return 0

    def holders(self) -> list[dict[str, Any]]:
        """Live reservations: request id, attempt token, worker, age (s), lease expiry."""
        return []

    def describe(self) -> dict[str, Any]:
        return {
            "type": self.type_name,
            "limit": self.capacity(),
            "in_flight": self.in_flight(),
            "holders": self.holders(),
        }

    def close(self) -> None:
        """Release client resources (HTTP sessions); reservations are untouched."""
