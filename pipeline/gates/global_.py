"""``global-max-concurrency``: at most ``limit`` reservations at once across every worker node
(one model server, or one pool of them, that must never see more than ``limit`` requests).

Params: ``limit`` (int > 0, required), ``gating_mode`` (``classifying``, the default: a full
gate refuses; ``blocking``: a full gate answers Wait) — as ``local-max-concurrency``, whose
lease-counted slot pool it shares the code of, with one pool for the whole cluster instead of
one per node: keys ``Keys.gate_holders(<name>)`` and ``Keys.gate_info(<name>)``.

``capacity()`` is the limit, for all nodes together (not ``per_node``), so the dispatchers
count the queue's dispatched attempts against it and look ahead past it: a full gate's Refuse
is ``wake_on_release``, and an attempt parked on any node takes a slot released on any other
(the release bell hears releases over Redis Pub/Sub). A holder whose node died is freed when
its lease expires, by the reaper of any node.
"""

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
