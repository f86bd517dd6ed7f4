"""Random sequences of acquire / release / retry / crash / lapse / reap against a model.

For ``local-max-concurrency`` and ``redis-quota`` (concurrency mode). Leases are judged by the
Redis server's clock, which a test cannot move: a lease "runs out" by having its expiry set in
the past (``lapse``: what a lease period without heartbeats does). Live holders renew on
every heartbeat, crashed ones never again; a stalled holder may lapse and then heartbeat
again, which must not revive it. Invariants after every step:

- ``in_flight()`` == the unexpired holders of the model, and never more than the limit
  (per attribute value for the quota);
- the gate's raw holder set == the model's holders that were neither released nor reaped;
- every decision and every reap result is exactly what the model predicts.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pipeline.gates import AcquireContext, Gate, GateEnv, build_gate

from .conftest import lapse

LEASE_S = 10.0
LIMIT = 2
USERS = ("alice", "bob")
SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass
class Holder:
    request_id: str
    token: str
    user: str
    expired: bool = False
    crashed: bool = False

    @property
    def name(self) -> str:
        return f"{self.request_id}:{self.token}"


@dataclass
class Model:
    holders: dict[str, Holder] = field(default_factory=dict)

    def live(self, user: str | None = None) -> list[Holder]:
        return [
            h for h in self.holders.values() if not h.expired and (user is None or h.user == user)
        ]


class GateMachine(RuleBasedStateMachine):
    """The model-checked machine; :func:`machine` binds it to a gate type and an env."""

    env: ClassVar[GateEnv]
    gate_type: ClassVar[str]
    params: ClassVar[dict[str, Any]]
    per_user: ClassVar[bool]

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.seq = 0
        self.gate: Gate = build_gate(
            self.gate_type, self.params, name=f"sm{uuid.uuid4().hex[:8]}", env=self.env
        )

    @initialize()
    def start(self) -> None:
        assert self.gate.in_flight() == 0

    def _ctx(self, request_id: str, token: str, user: str) -> AcquireContext:
        return AcquireContext(
            request_id=request_id,
            token=token,
            queue="q",
            worker="w",
            lease_s=LEASE_S,
            deadline=2e9,
            metadata={"userid": user},
        )

    def _acquire(self, request_id: str, user: str) -> None:
        self.seq += 1
        token = f"t{self.seq}"
        expected = len(self.model.live(user if self.per_user else None)) < LIMIT
        decision = self.gate.acquire(self._ctx(request_id, token, user))
        assert decision.admitted == expected
        if expected:
            h = Holder(request_id, token, user)
            self.model.holders[h.name] = h

    @rule(user=st.sampled_from(USERS))
    def acquire(self, user: str) -> None:
        self.seq += 1
        self._acquire(f"r{self.seq}", user)

    @precondition(lambda self: self.model.holders)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model.holders)))
        assert self.gate.release(name) is True
        del self.model.holders[name]
        assert self.gate.release(name) is False  # idempotent

    @precondition(lambda self: self.model.holders)
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """The attempt ends retriable: release, then acquire again with a new token."""
        name = data.draw(st.sampled_from(sorted(self.model.holders)))
        h = self.model.holders.pop(name)
        assert self.gate.release(name) is True
        self._acquire(h.request_id, h.user)

    @precondition(lambda self: any(not h.crashed for h in self.model.holders.values()))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        alive = sorted(n for n, h in self.model.holders.items() if not h.crashed)
        self.model.holders[data.draw(st.sampled_from(alive))].crashed = True

    @rule()
    def heartbeat(self) -> None:
        """Every holder that has not crashed renews — a lapsed one too (a stalled worker
        that woke up): its lease must stay expired."""
        beating = [h.name for h in self.model.holders.values() if not h.crashed]
        self.gate.renew(beating, LEASE_S)

    @precondition(lambda self: any(not h.expired for h in self.model.holders.values()))
    @rule(data=st.data())
    def lapse(self, data: st.DataObject) -> None:
        """A lease period passes without a heartbeat for one holder (crashed or stalled)."""
        live = sorted(n for n, h in self.model.holders.items() if not h.expired)
        name = data.draw(st.sampled_from(live))
        lapse(self.env, name)
        self.model.holders[name].expired = True

    @rule()
    def reap(self) -> None:
        expected = {n for n, h in self.model.holders.items() if h.expired}
        assert set(self.gate.reap()) == expected
        for n in expected:
            del self.model.holders[n]

    @rule()
    def release_unknown(self) -> None:
        assert self.gate.release(f"ghost:{self.seq}") is False

    @invariant()
    def counts_match(self) -> None:
        live = self.model.live()
        assert self.gate.in_flight() == len(live)
        held = {f"{h['request_id']}:{h['attempt']}" for h in self.gate.holders()}
        assert held == {h.name for h in live}
        for user in USERS if self.per_user else (None,):
            assert len(self.model.live(user)) <= LIMIT
        if not self.per_user:
            assert len(live) <= LIMIT

    @invariant()
    def raw_holders_match(self) -> None:
        raw = raw_holders(self.env, self.gate)
        assert raw == set(self.model.holders)

    def teardown(self) -> None:
        for name in list(self.model.holders):
            self.gate.release(name)
        assert raw_holders(self.env, self.gate) == set()
        self.gate.close()


def machine(env: GateEnv, gate_type: str, params: dict[str, Any], per_user: bool) -> type:
    attrs = {"env": env, "gate_type": gate_type, "params": params, "per_user": per_user}
    return type(f"{gate_type}-machine", (GateMachine,), attrs)


def raw_holders(env: GateEnv, gate: Gate) -> set[str]:
    """Every holder the gate's Redis keys record, expired or not."""
    c = env.client
    if gate.type_name == "local-max-concurrency":
        key = env.keys.gate_holders(f"{gate.name}@{env.node}")
        return set(c.zrange(key, 0, -1))
    members: set[str] = set()
    for user in USERS:
        members |= set(c.zrange(gate.holders_key(user), 0, -1))
    index = set(c.hkeys(env.keys.gate_info(gate.name)))
    assert members == index  # the holder index and the slot sets agree
    return members


def test_local_max_concurrency_state_machine(genv: GateEnv) -> None:
    m = machine(genv, "local-max-concurrency", {"limit": LIMIT}, per_user=False)
    run_state_machine_as_test(m, settings=SETTINGS)


def test_redis_quota_concurrency_state_machine(genv: GateEnv) -> None:
    params = {"mode": "concurrency", "limit": LIMIT}
    m = machine(genv, "redis-quota", params, per_user=True)
    run_state_machine_as_test(m, settings=SETTINGS)
