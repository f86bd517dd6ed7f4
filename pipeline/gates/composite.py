"""Gates made of other gates: ``composite`` and ``wait-on-refuse``.

``composite`` — param ``gates``: a non-empty list of ``{gate_type, gate_params}`` (array or
JSON string). Inner gate *i* is named ``<name>/<i>`` (its Redis keys use that name).

- budget = min of the inner budgets; capacity = min of the inner capacities that are not
  None (``per_node`` follows the inner gate that sets it).
- acquire runs the inner gates in order, all-or-nothing: each sees the labels the earlier
  ones set; on the first non-Continue (or exception) the reservations already taken are
  released in reverse order and that decision (labels merged) is returned (or the exception
  re-raised) — except that on a refusal the attempt parks through (``wake_on_release``), the
  per-key quota slots taken (``Gate.per_key``) are kept: they are the attempt's own tenant's,
  it asks again when woken, and its release on every exit path frees them.
- hands over (``hands_over``) when it is per-key quotas followed by exactly one slot gate
  that hands over: an attempt parked on that slot gate already holds its own quota slots, so
  a holder that is done hands it the slot gate's slot (:meth:`transfer`) and releases its
  own quota slots.
- release / renew / reap fan out to every inner gate (reap's holders de-duplicated), and so
  does settle to the token budgets among them (``settles``); a rollback refunds a token
  budget's charge (settles it to 0) before it releases.
- in_flight = number of distinct holders that hold a reservation in any inner gate, and
  holders() lists them (first inner gate's entry wins): 0 iff nothing leaks anywhere, and
  equal to the requests in flight when every counting inner gate sees every request.

``wait-on-refuse`` — param ``gate``: one inner config (object or JSON string), named like
the outer gate. An inner Refuse becomes Wait (same reason and labels); every other decision,
and everything else, is the inner gate's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ..store.sched import QuotaSpec
from .base import (
    CONTINUE,
    AcquireContext,
    Decision,
    Gate,
    GateEnv,
    PreparedAcquire,
    PreparedRelease,
    Verdict,
    split_replies,
)
from .params import Params

log = logging.getLogger(__name__)


def build_inner(
    p: Params, key: str, gate_type: str, params: dict[str, Any], name: str, env: GateEnv | None
) -> Gate:
    """Build a nested gate; its ConfigError is re-raised naming the outer param."""
    from .registry import build_gate  # at call time: the registry imports this module

    try:
        return build_gate(gate_type, params, name=name, env=env)
    except ConfigError as exc:
        raise p.error(key, f"-> {exc}") from None


class CompositeGate(Gate):
    type_name = "composite"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        self.gates: list[Gate] = [
            build_inner(p, f"gates[{i}]", gate_type, inner, f"{name}/{i}", env)
            for i, (gate_type, inner) in enumerate(p.gate_configs("gates"))
        ]
        self._follow_capacity()

    @classmethod
    def of(cls, name: str, gates: Sequence[Gate], env: GateEnv | None) -> CompositeGate:
        """A composite of gates already built (e.g. a queue's gate chained with its worker
        pool's): same semantics; the inner gates keep their own names and keys."""
        if not gates:
            raise ConfigError(f"composite gate {name!r}: needs at least one gate")
        self = cls.__new__(cls)
        Gate.__init__(self, name, {}, env)
        self.gates = list(gates)
        self._follow_capacity()
        return self

    def _follow_capacity(self) -> None:
        """``per_node`` is that of the inner gate with the smallest capacity; it hands over
        when its gates are per-key quotas and then one slot gate that hands over."""
        counting = [g for g in self.gates if g.capacity() is not None]
        if counting:
            smallest = min(counting, key=lambda g: g.capacity() or 0)
            setattr(self, "per_node", smallest.per_node)  # noqa: B010 - instance override
        *keyed, last = self.gates
        slot = last.hands_over and not last.per_key and all(g.per_key for g in keyed)
        setattr(self, "hands_over", bool(keyed) and slot)  # noqa: B010 - instance override
        static = all(g.static_budget for g in self.gates)
        setattr(self, "static_budget", static)  # noqa: B010 - instance override
        settles = any(g.settles for g in self.gates)
        setattr(self, "settles", settles)  # noqa: B010 - instance override

    def handover_bell(self, queue: str, wake: Sequence[str]) -> str | None:
        return queue if self.hands_over else None

    def transfer(self, giver: str, ctx: AcquireContext) -> bool:
        """The slot gate's slot passes to ``ctx`` (parked on it, holding its own quota slots);
        the giver's quota slots are released."""
        *keyed, last = self.gates
        for gate in keyed:
            gate.release(giver)
        return last.transfer(giver, ctx)

    def budget(self) -> float:
        return min((g.budget() for g in self.gates), default=1.0)

    def dispatch_budget(self) -> float:
        return min((g.dispatch_budget() for g in self.gates), default=1.0)

    def capacity(self) -> int | None:
        caps = [c for c in (g.capacity() for g in self.gates) if c is not None]
        return min(caps) if caps else None

    def quota_specs(self) -> list[QuotaSpec]:
        return [s for g in self.gates for s in g.quota_specs()]

    def wake_keys(self, ctx: AcquireContext) -> list[str]:
        return [k for g in self.gates for k in g.wake_keys(ctx)]

    def acquire(self, ctx: AcquireContext) -> Decision:
        return self._acquire(ctx, None)

    def acquire_behind(self, ctx: AcquireContext, bell: str) -> Decision | None:
        """Others of this process are parked for the slot gate's slot (holding their own
        quota slots): take this attempt's quota slots, and park behind them for the slot
        without asking the slot gate (its :meth:`~Gate.parked_decision`)."""
        if not self.hands_over:
            return None
        parked = self.gates[-1].parked_decision(bell)
        return None if parked is None else self._acquire(ctx, parked)

    def start_bell(self, queue: str, tenant: Mapping[str, str]) -> str | None:
        return queue if self.hands_over else None

    def prepare_acquire(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str] | None = None,
        behind: str | None = None,
    ) -> PreparedAcquire | None:
        """Every inner gate's acquire as calls, when each is; ``behind``: the slot gate's
        :meth:`~Gate.parked_decision` instead of its call. All calls run: :meth:`_decided`
        gives back what the gates after a refusing one took."""
        parked = None
        asked = self.gates
        if behind is not None:
            parked = self.gates[-1].parked_decision(behind) if self.hands_over else None
            if parked is None:
                return None
            asked = self.gates[:-1]
        parts = [g.prepare_acquire(holder, worker, lease_s, tenant) for g in asked]
        if any(p is None for p in parts):
            return None
        ready = [p for p in parts if p is not None]

        def decisions(replies: Sequence[Any]) -> list[Decision]:
            out = [p.decide(r) for p, r in split_replies(ready, replies)]
            return out if parked is None else [*out, parked]

        def took(replies: Sequence[Any]) -> bool:
            return any(p.took(r) for p, r in split_replies(ready, replies))

        calls = tuple(c for p in ready for c in p.calls)
        return PreparedAcquire(
            calls, lambda replies: self._decided(decisions(replies), holder), took
        )

    def _decided(self, decisions: list[Decision], holder: str) -> Decision:
        """:meth:`acquire`'s all-or-nothing rule over decisions taken together (one per
        inner gate, in order): at the first that is not Continue, the reservations the others
        took are given back (the earlier per-key quotas' kept when it parks)."""
        labels: dict[str, str] = {}
        for i, decision in enumerate(decisions):
            labels.update(decision.labels)
            if decision.verdict is not Verdict.CONTINUE:
                rest = zip(self.gates[i + 1 :], decisions[i + 1 :], strict=True)
                later = [g for g, d in rest if d.admitted]
                taken = self.gates[:i]
                if decision.wake_on_release:  # it parks: keep its tenant's own slots
                    taken = [g for g in taken if not g.per_key]
                self._give_back([*taken, *later], holder)
                gate = self.gates[i]
                return dataclasses.replace(
                    decision, labels=labels, gate=decision.gate or gate.type_name
                )
        return Decision(Verdict.CONTINUE, labels=labels) if labels else CONTINUE

    def _give_back(self, gates: Sequence[Gate], holder: str) -> None:
        """Release ``holder`` on ``gates``, in reverse order (none of them settles)."""
        for gate in reversed(gates):
            try:
                gate.release(holder)
            except Exception as exc:  # noqa: BLE001 - keep giving back; the lease expires
                log.warning(
                    "composite gate %s: give-back of %s on %s failed: %s",
                    self.name,
                    holder,
                    gate.name,
                    exc,
                )

    def _acquire(self, ctx: AcquireContext, last: Decision | None) -> Decision:
        """The inner gates in order, all-or-nothing; ``last``: the last gate's decision, given
        instead of asking it."""
        taken: list[Gate] = []
        labels: dict[str, str] = {}
        try:
            for i, gate in enumerate(self.gates):
                step = dataclasses.replace(ctx, labels={**ctx.labels, **labels})
                if last is not None and i == len(self.gates) - 1:
                    decision = last
                else:
                    decision = gate.acquire(step)
                labels.update(decision.labels)
                if decision.verdict is not Verdict.CONTINUE:
                    if decision.wake_on_release:  # it parks: keep its tenant's own slots
                        taken = [g for g in taken if not g.per_key]
                    self._rollback(taken, ctx)
                    return dataclasses.replace(
                        decision, labels=labels, gate=decision.gate or gate.type_name
                    )
                taken.append(gate)
        except BaseException:
            self._rollback(taken, ctx)
            raise
        return Decision(Verdict.CONTINUE, labels=labels) if labels else CONTINUE

    def _rollback(self, taken: list[Gate], ctx: AcquireContext) -> None:
        """Give back what the gates in ``taken`` granted: their reservations, and the charge
        of a token budget (refunded: nothing is sent)."""
        for gate in reversed(taken):
            try:
                if gate.settles:
                    gate.settle(ctx, 0)
                gate.release(ctx.holder)
            except Exception as exc:  # noqa: BLE001 - keep rolling back; the lease expires
                log.warning(
                    "composite gate %s: rollback of %s on %s failed: %s",
                    self.name,
                    ctx.holder,
                    gate.name,
                    exc,
                )

    def settle(self, ctx: AcquireContext, tokens: int | None) -> None:
        for gate in self.gates:
            if gate.settles:
                gate.settle(ctx, tokens)

    def release(self, holder: str) -> bool:
        freed = False
        for gate in reversed(self.gates):
            freed = gate.release(holder) or freed
        return freed

    def prepare_release(self, holder: str) -> PreparedRelease | None:
        """Every inner gate's release, in :meth:`release`'s order, when each is one call."""
        parts = [g.prepare_release(holder) for g in reversed(self.gates)]
        if any(p is None for p in parts):
            return None
        return PreparedRelease.joined([p for p in parts if p is not None], any)

    def prepare_transfer(self, giver: str, ctx: AcquireContext) -> PreparedRelease | None:
        """:meth:`transfer` as calls: the giver's quota slots released, then the slot gate's
        slot handed over."""
        if not self.hands_over:
            return None
        *keyed, last = self.gates
        parts = [g.prepare_release(giver) for g in keyed]
        parts.append(last.prepare_transfer(giver, ctx))
        if any(p is None for p in parts):
            return None
        return PreparedRelease.joined([p for p in parts if p is not None], lambda r: r[-1])

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        listed = list(holders)
        for gate in self.gates:
            gate.renew(listed, lease_s)

    def reap(self) -> list[str]:
        freed: dict[str, None] = {}
        for gate in self.gates:
            freed.update(dict.fromkeys(gate.reap()))
        return list(freed)

    def holders(self) -> list[dict[str, Any]]:
        seen: dict[tuple[str, str], dict[str, Any]] = {}
        for gate in self.gates:
            for entry in gate.holders():
                seen.setdefault((entry["request_id"], entry["attempt"]), entry)
        return list(seen.values())

    def in_flight(self) -> int:
        return len(self.holders())

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gates": [g.describe() for g in self.gates]}

    def close(self) -> None:
        for gate in self.gates:
            gate.close()


class Wrapper(Gate):
    """A gate around one inner gate: everything is the inner gate's unless overridden."""

    inner: Gate

    def _wrap(self, inner: Gate) -> None:
        self.inner = inner
        setattr(self, "per_node", inner.per_node)  # noqa: B010 - instance override
        setattr(self, "static_budget", inner.static_budget)  # noqa: B010 - instance override
        setattr(self, "settles", inner.settles)  # noqa: B010 - instance override

    def budget(self) -> float:
        return self.inner.budget()

    def dispatch_budget(self) -> float:
        return self.inner.dispatch_budget()

    def capacity(self) -> int | None:
        return self.inner.capacity()

    def quota_specs(self) -> list[QuotaSpec]:
        return self.inner.quota_specs()

    def wake_keys(self, ctx: AcquireContext) -> list[str]:
        return self.inner.wake_keys(ctx)

    def acquire(self, ctx: AcquireContext) -> Decision:
        return self.inner.acquire(ctx)

    def settle(self, ctx: AcquireContext, tokens: int | None) -> None:
        self.inner.settle(ctx, tokens)

    def release(self, holder: str) -> bool:
        return self.inner.release(holder)

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        self.inner.renew(holders, lease_s)

    def reap(self) -> list[str]:
        return self.inner.reap()

    def in_flight(self) -> int:
        return self.inner.in_flight()

    def holders(self) -> list[dict[str, Any]]:
        return self.inner.holders()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gate": self.inner.describe()}

    def close(self) -> None:
        self.inner.close()


class WaitOnRefuseGate(Wrapper):
    type_name = "wait-on-refuse"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        gate_type, inner = p.gate_config("gate")
        self._wrap(build_inner(p, "gate", gate_type, inner, name, env))

    def acquire(self, ctx: AcquireContext) -> Decision:
        decision = self.inner.acquire(ctx)
        if decision.verdict is Verdict.REFUSE:
            gate = decision.gate or self.inner.type_name
            return dataclasses.replace(decision, verdict=Verdict.WAIT, gate=gate)
        return decision


__all__ = ["CompositeGate", "WaitOnRefuseGate", "Wrapper", "build_inner"]
