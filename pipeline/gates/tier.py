"""``tier-priority-admission``: what a saturated pool does with each tier (docs/gates.md)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..store.sched import QuotaSpec, TokenSpec
from .base import AcquireContext, Decision, GateEnv, Verdict
from .composite import Build, Wrapper, build_inner
from .params import Params

DROP_STATUS = 429
DROP_PAYLOAD = json.dumps({"error": "Too Many Requests", "code": DROP_STATUS})


class TierPriorityAdmissionGate(Wrapper):
    type_name = "tier-priority-admission"

    def __init__(
        self, name: str, params: dict[str, Any], env: GateEnv | None, build: Build
    ) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        gate_type = p.get_str("saturation_gate", required=True)
        inner = p.get_object("saturation_gate_params")
        self.tier_label = p.get_str("tier_label", "tier")
        self._wrap(build_inner(build, p, "saturation_gate", gate_type, inner, name, env))

    def quota_specs(self) -> list[QuotaSpec]:
        """None: an inner refusal is an outcome here, the dispatcher must not hold back for it."""
        return []

    def token_specs(self) -> list[TokenSpec]:
        """None, as :meth:`quota_specs`."""
        return []

    def acquire(self, ctx: AcquireContext) -> Decision:
        decision = self.inner.acquire(ctx)
        if decision.verdict is not Verdict.REFUSE or decision.reason == "error":
            return decision
        labels = {**ctx.labels, **decision.labels}
        classification = labels.get("classification")
        tier = labels.get(self.tier_label) or ctx.metadata.get(self.tier_label)
        if classification == "reserved":
            return dataclasses.replace(decision, verdict=Verdict.WAIT)
        if classification == "overflow" and tier == "interactive":
            return Decision(
                Verdict.DROP,
                reason="dropped",
                labels=dict(decision.labels),
                status_code=DROP_STATUS,
                payload=DROP_PAYLOAD,
            )
        return decision

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tier_label": self.tier_label}
