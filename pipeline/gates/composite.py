"""Gates made of other gates: ``composite`` (all-or-nothing over its parts) and
``wait-on-refuse``; their rules are in docs/gates.md."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..errors import ConfigError
from .base import (
    CONTINUE,
    AcquireContext,
    Admission,
    Batched,
    Calls,
    Decision,
    Gate,
    GateEnv,
    HandsOver,
    Verdict,
    per_key,
    settle,
)
from .params import Params

log = logging.getLogger(__name__)


class Build(Protocol):
    """How a gate made of other gates builds them: the catalogue's ``build_gate``, handed in by
    the catalogue (``registry.py``), which imports this module."""

    def __call__(
        self,
        gate_type: str | None,
        params: dict[str, Any] | None,
        *,
        name: str,
        env: GateEnv | None = None,
    ) -> Gate: ...


def build_inner(
    build: Build,
    p: Params,
    key: str,
    gate_type: str,
    params: dict[str, Any],
    name: str,
    env: GateEnv | None,
) -> Gate:
    """Build a nested gate; its ConfigError is re-raised naming the outer param."""
    try:
        return build(gate_type, params, name=name, env=env)
    except ConfigError as exc:
        raise p.error(key, f"-> {exc}") from None


class CompositeGate(Batched, HandsOver):
    type_name = "composite"

    def __init__(
        self, name: str, params: dict[str, Any], env: GateEnv | None, build: Build
    ) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        self._bind(
            [
                build_inner(build, p, f"gates[{i}]", gate_type, inner, f"{name}/{i}", env)
                for i, (gate_type, inner) in enumerate(p.gate_configs("gates"))
            ]
        )

    @classmethod
    def of(cls, name: str, gates: Sequence[Gate], env: GateEnv | None) -> CompositeGate:
        """A composite of gates already built (a queue's gate and its pool's)."""
        if not gates:
            raise ConfigError(f"composite gate {name!r}: needs at least one gate")
        self = cls.__new__(cls)
        Gate.__init__(self, name, {}, env)
        self._bind(gates)
        return self

    def _bind(self, gates: Sequence[Gate]) -> None:
        self.gates = list(gates)
        counting = [g for g in self.gates if g.capacity() is not None]
        if counting:
            self.per_node = min(counting, key=lambda g: g.capacity() or 0).per_node
        *keyed, last = self.gates
        # it hands over the slot of a slot gate after per-key quotas only
        hands = keyed and all(map(per_key, keyed)) and not per_key(last)
        self._slot = last if hands and isinstance(last, HandsOver) else None
        # and behind one per-key quota, all its slots to an attempt parked on the holder's key
        one = keyed[0] if self._slot is not None and len(keyed) == 1 else None
        self._key = one if isinstance(one, HandsOver) else None

    def parts(self) -> Sequence[Gate]:
        return self.gates

    @property
    def handover_may_fail(self) -> bool:  # type: ignore[override]
        return self._slot is not None and self._slot.handover_may_fail

    def acquire(self, ctx: AcquireContext) -> Decision:
        decisions: list[Decision] = []
        labels: dict[str, str] = {}
        try:
            for gate in self.gates:
                decision = gate.acquire(dataclasses.replace(ctx, labels={**ctx.labels, **labels}))
                decisions.append(decision)
                labels.update(decision.labels)
                if not decision.admitted:
                    break
        except BaseException:
            self._give_back(self.gates[: len(decisions)], ctx.holder, ctx)
            raise
        return self._combined(decisions, [], ctx.holder, ctx)

    def _combined(
        self,
        decisions: list[Decision],
        later: list[Gate],
        holder: str,
        ctx: AcquireContext | None = None,
    ) -> Decision:
        """The whole's decision from the inner ones up to the first not Continue; what the
        others took is given back (and ``later`` gates', a batched acquire asked them all)."""
        labels = {k: v for d in decisions for k, v in d.labels.items()}
        last = decisions[-1]
        if last.admitted:
            return Decision(Verdict.CONTINUE, labels=labels) if labels else CONTINUE
        taken = self.gates[: len(decisions) - 1]
        if last.wake_on_release:  # it parks: keep its tenant's own slots
            taken = [g for g in taken if not per_key(g)]
        self._give_back([*taken, *later], holder, ctx)
        gate = last.gate or self.gates[len(decisions) - 1].type_name
        return dataclasses.replace(last, labels=labels, gate=gate)

    def _give_back(self, gates: Sequence[Gate], holder: str, ctx: AcquireContext | None) -> None:
        for gate in reversed(gates):
            try:
                if ctx is not None:
                    settle(gate, ctx, 0)
                gate.release(holder)
            except Exception as exc:  # noqa: BLE001 - keep giving back; the lease expires
                log.warning(
                    "composite gate %s: give-back of %s on %s failed: %s",
                    self.name,
                    holder,
                    gate.name,
                    exc,
                )

    def acquire_calls(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str],
        behind: bool = False,
        priority: int | None = None,
    ) -> Calls[Admission] | None:
        if behind and self._slot is None:
            return None
        parts = [
            g.acquire_calls(
                holder, worker, lease_s, tenant, behind and g is self._slot, priority=priority
            )
            if isinstance(g, Batched)
            else None
            for g in self.gates
        ]
        ready = [p for p in parts if p is not None]
        if len(ready) < len(parts):
            return None

        def decided(got: list[Admission]) -> Admission:
            decisions = [d for d, _ in got]
            n = next((i + 1 for i, d in enumerate(decisions) if not d.admitted), len(got))
            later = [g for g, d in zip(self.gates[n:], decisions[n:], strict=True) if d.admitted]
            return self._combined(decisions[:n], later, holder), any(t for _, t in got)

        return Calls.join(ready, decided)

    def release_calls(self, holder: str) -> Calls[bool] | None:
        parts = [
            g.release_calls(holder) if isinstance(g, Batched) else None
            for g in reversed(self.gates)
        ]
        ready = [p for p in parts if p is not None]
        return Calls.join(ready, any) if len(ready) == len(parts) else None

    def handover_bells(self, queue: str, metadata: Mapping[str, str]) -> tuple[str, ...]:
        """The slot gate's slot, to an attempt parked for it (which holds its own quota slots);
        else, behind one per-key quota, the holder's key: its quota slot and the slot gate's,
        to an attempt of the same tenant parked there (refused by the key; the slot gate
        would have let it in). Then nothing is freed for an attempt just dispatched to take
        first, while the parked one is still waking."""
        if self._slot is None:
            return ()
        key = self._key.handover_bells(queue, metadata) if self._key is not None else ()
        return (queue, *key)

    def transfer_calls(self, giver: str, ctx: AcquireContext, bell: str) -> Calls[bool]:
        """Parked on the queue: the giver's quota slots released, then the slot gate's handed
        to ``ctx``. Parked on the key: the key's slot and the slot gate's handed to ``ctx``
        (held when either was: its release frees both; one not taken is logged, as a hand-over
        whose giver's lease had lapsed on a full gate is)."""
        assert self._slot is not None
        if self._key is not None and bell != ctx.queue:
            parts = [
                self._key.transfer_calls(giver, ctx, bell),
                self._slot.transfer_calls(giver, ctx, bell),
            ]

            def taken(done: list[Any]) -> bool:
                if any(done) and not all(done):
                    log.warning(
                        "composite gate %s: of %s's slots handed to %s, the %s was not taken "
                        "(its lease had lapsed and that gate is full)",
                        self.name,
                        giver,
                        ctx.holder,
                        "key's" if not done[0] else "slot gate's",
                    )
                return any(done)

            return Calls.join(parts, taken)

        def released(gate: Gate) -> Calls[bool]:
            calls = gate.release_calls(giver) if isinstance(gate, Batched) else None
            return calls or Calls((), lambda _: gate.release(giver))

        parts = [released(g) for g in self.gates[:-1]]
        parts.append(self._slot.transfer_calls(giver, ctx, bell))
        return Calls.join(parts, lambda done: bool(done[-1]))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gates": [g.describe() for g in self.gates]}


class Wrapper(Gate):
    """A gate around one inner gate, its one part: what it does not override fans out to it."""

    inner: Gate

    def _wrap(self, inner: Gate) -> None:
        self.inner = inner
        self.per_node = inner.per_node

    def parts(self) -> Sequence[Gate]:
        return (self.inner,)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gate": self.inner.describe()}


class WaitOnRefuseGate(Wrapper):
    type_name = "wait-on-refuse"

    def __init__(
        self, name: str, params: dict[str, Any], env: GateEnv | None, build: Build
    ) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        gate_type, inner = p.gate_config("gate")
        self._wrap(build_inner(build, p, "gate", gate_type, inner, name, env))

    def acquire(self, ctx: AcquireContext) -> Decision:
        decision = self.inner.acquire(ctx)
        if decision.verdict is Verdict.REFUSE:
            gate = decision.gate or self.inner.type_name
            return dataclasses.replace(decision, verdict=Verdict.WAIT, gate=gate)
        return decision
