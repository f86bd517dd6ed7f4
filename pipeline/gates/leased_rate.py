"""``redis-leased-rate``: a pool-wide admission rate an external planner leases (the reference's
dispatch-control contract, docs/gates.md); one token bucket for every node, fails closed."""

from __future__ import annotations

import logging
import math
from typing import Any

from ..store.scripts import register
from .base import CONTINUE, AcquireContext, Budgeted, Decision, GateEnv, Verdict, note_problem
from .params import Params
from .redis_budget import OnRedis

log = logging.getLogger(__name__)

API_VERSION = "llm-d.ai/v1alpha1"
ADMITTED, EMPTY, PAUSED, INVALID = 1, 0, -1, -2


def owning_pool(name: str) -> str | None:
    """The worker pool of a pool gate (named ``pool.<id>``, inner gates ``pool.<id>/<i>``)."""
    if name.startswith("pool."):
        return name[len("pool.") :].split("/")[0] or None
    return None


class RedisLeasedRateGate(Budgeted, OnRedis):
    type_name = "redis-leased-rate"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        self.control_key = p.get_str("control_key", required=True)
        pool = p.opt_str("pool_id") or owning_pool(name)
        if not pool:
            raise p.error("pool_id", "is required (it defaults to the pool of a pool gate)")
        self.pool_id = pool
        self.burst_s = p.get_float("burst_seconds", 1.0, lo=0.0, lo_open=True)
        self.state_key = p.opt_str("state_key") or ""
        if not self.state_key and env is not None:
            self.state_key = env.keys.leased_rate_state(self.control_key)
        # the lease as last read, for the pipeline_drain_limit_* gauges (0 when invalid)
        self.limit_rps = 0.0
        self.lease_valid = 0  # 1 also while paused
        self.valid_until_s = 0.0
        self.decision_id = ""
        self._problem: str | None = None
        if self.client is not None:
            self._script = register(self.client, "gate_leased_rate")

    def _call(self, mode: str) -> int | None:
        """Run the script (``peek`` or ``take``) and record the lease: the verdict, or None
        when the lease cannot be read."""
        try:
            if self.client is None:
                raise RuntimeError(f"gate {self.name!r} is not bound to Redis (env is None)")
            verdict, rate, until, decision, reason = self._script(
                keys=[self.control_key, self.state_key],
                args=[API_VERSION, self.pool_id, repr(self.burst_s), mode],
            )
            if int(verdict) == INVALID:
                self._note(problem=f"no valid lease ({reason})")
            else:
                self._note(float(rate), int(until) / 1000.0, str(decision))
            return int(verdict)
        except Exception as exc:  # noqa: BLE001 - budget() never raises; both fail closed
            self._note(problem=f"cannot read the lease: {exc}")
            return None

    def _note(
        self,
        rate: float = 0.0,
        until_s: float = 0.0,
        decision: str = "",
        problem: str | None = None,
    ) -> None:
        self.limit_rps, self.valid_until_s = rate, until_s
        self.lease_valid = int(problem is None)
        if decision and decision != self.decision_id:
            log.info(
                "redis-leased-rate gate %s: pool %s decision %s, %g req/s until %.3f",
                self.name, self.pool_id, decision, rate, until_s,
            )  # fmt: skip
        self.decision_id = decision
        effect = f"refusing (fails closed) at {self.control_key}"
        self._problem = note_problem(self, self._problem, problem, effect)

    def budget(self) -> float:
        """1 for a valid lease with a rate > 0, else 0 (never touches the bucket)."""
        return 1.0 if self._call("peek") == ADMITTED else 0.0

    def acquire(self, ctx: AcquireContext) -> Decision:
        verdict = self._call("take")
        if verdict is None:  # a Redis error refuses (fails closed)
            return Decision(Verdict.REFUSE, reason="error")
        if verdict == ADMITTED:
            return CONTINUE
        return Decision(Verdict.REFUSE, reason="gate_closed")

    def describe(self) -> dict[str, Any]:
        self.budget()  # read the lease now
        return {
            **super().describe(),
            "control_key": self.control_key,
            "pool_id": self.pool_id,
            "limit_rps": self.limit_rps,
            "lease_valid": bool(self.lease_valid),
            "valid_until_s": self.valid_until_s if math.isfinite(self.valid_until_s) else None,
            "decision_id": self.decision_id,
        }
