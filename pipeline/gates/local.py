"""``local-max-concurrency``: at most ``limit`` reservations at once per worker node, held in
Redis so the limit spans a node's processes; ``global-max-concurrency``: the same slot pool, one
for the whole cluster instead of one per node."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .base import Calls, Decision, GateEnv, Verdict
from .leases import LeaseScripts, LeaseSet, SlotGate
from .params import Params

log = logging.getLogger(__name__)


class LocalMaxConcurrencyGate(SlotGate):
    type_name = "local-max-concurrency"
    per_node = True

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        self.limit = p.get_int("limit", lo=1)
        self.gating_mode = p.get_choice("gating_mode", ("classifying", "blocking"), "classifying")
        verdict = Verdict.WAIT if self.gating_mode == "blocking" else Verdict.REFUSE
        self._full = Decision(verdict, reason="gate_closed", wake_on_release=True)
        self._slots: LeaseSet | None = None
        if env is not None:
            self._slots = self._node_slots(LeaseScripts(env.client), env.node)

    def _node_slots(self, scripts: LeaseScripts, node: str) -> LeaseSet:
        assert self.env is not None
        keys = self.env.keys
        if not self.per_node:
            return LeaseSet(scripts, keys.gate_holders(self.name), keys.gate_info(self.name))
        return LeaseSet(
            scripts,
            keys.gate_node_holders(self.name, node),
            keys.gate_node_info(self.name, node),
            registry=(keys.gate_nodes(self.name), node),
        )

    def _all_slots(self) -> list[LeaseSet]:
        """This node's slot pool first, then every other node's that holds one."""
        if self.env is None:
            return []
        if not self.per_node:
            return [self.slots]
        nodes = self.env.client.smembers(self.env.keys.gate_nodes(self.name))
        names = sorted(n.decode() if isinstance(n, bytes) else n for n in nodes)
        others = [self._node_slots(self.slots.scripts, n) for n in names if n != self.env.node]
        return [self.slots, *others]

    @property
    def slots(self) -> LeaseSet:
        if self._slots is None:
            raise RuntimeError(f"gate {self.name!r} is not bound to Redis (env is None)")
        return self._slots

    def budget(self) -> float:
        """Free share of this node's slots; 0.0 when Redis cannot be read."""
        try:
            return max(0.0, (self.limit - self.slots.count()) / self.limit)
        except Exception as exc:  # noqa: BLE001 - budget() never raises; fail closed
            log.warning("%s gate %s: cannot count holders: %s", self.type_name, self.name, exc)
            return 0.0

    def capacity(self) -> int:
        return self.limit

    def _pool(self, metadata: Mapping[str, str]) -> tuple[LeaseSet, dict[str, Any]]:
        return self.slots, {}

    def _refusal(self, metadata: Mapping[str, str]) -> Decision:
        return self._full

    def release_calls(self, holder: str) -> Calls[bool]:
        """Release wherever the holder is: normally this node's pool, but a reaper on another
        node frees a dead node's holders too."""

        def done(replies: Any) -> bool:
            return bool(int(replies[0])) or any(s.release(holder)() for s in self._all_slots()[1:])

        return Calls((self.slots.release(holder),), done)

    def handover_bells(self, queue: str, metadata: Mapping[str, str]) -> tuple[str, ...]:
        return (queue,)

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        self.slots.renew(list(holders), lease_s)

    def reap(self) -> list[str]:
        """Free expired leases on every node (a dead node cannot reap its own), and forget
        nodes whose pool is gone."""
        freed = [h for s in self._all_slots() for h in s.reap()]
        if self.env is not None and self.per_node:
            keys = self.env.keys  # forget them: see gate_nodes_prune.lua
            self.slots.scripts.prune_nodes(
                keys=[keys.gate_nodes(self.name), keys.gate_node_prefix(self.name)]
            )
        return freed

    def in_flight(self) -> int:
        """Unexpired leases on all nodes (``budget`` counts this node's only)."""
        return sum(s.count() for s in self._all_slots())

    def holders(self) -> list[dict[str, Any]]:
        return [h for s in self._all_slots() for h in s.live()]

    def describe(self) -> dict[str, Any]:
        node = self.env.node if self.env is not None and self.per_node else None
        return {**super().describe(), "gating_mode": self.gating_mode, "node": node}


class GlobalMaxConcurrencyGate(LocalMaxConcurrencyGate):
    type_name = "global-max-concurrency"
    per_node = False
