"""``global-max-concurrency``: ``local-max-concurrency``'s lease-counted slot pool, one for the
whole cluster instead of one per node."""

from __future__ import annotations

from typing import Any

from .leases import LeaseSet
from .local import LocalMaxConcurrencyGate


class GlobalMaxConcurrencyGate(LocalMaxConcurrencyGate):
    type_name = "global-max-concurrency"
    per_node = False

    def _node_slots(self, node: str) -> LeaseSet:
        assert self.env is not None and self._scripts is not None
        keys = self.env.keys
        return LeaseSet(self._scripts, keys.gate_holders(self.name), keys.gate_info(self.name))

    def _all_slots(self) -> list[LeaseSet]:
        return [self.slots] if self.env is not None else []

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "node": None}
