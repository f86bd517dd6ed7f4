"""The gate catalogue: ``gate_type`` → class (:data:`GATE_TYPES`), and :func:`build_gate`,
which builds one from a queue's ``gate_type`` / ``gate_params``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .base import Gate, GateEnv
from .composite import CompositeGate, WaitOnRefuseGate
from .constant import ConstantGate
from .global_ import GlobalMaxConcurrencyGate
from .leased_rate import RedisLeasedRateGate
from .local import LocalMaxConcurrencyGate
from .metric import PrometheusBudgetGate, PrometheusQueryGate, PrometheusSaturationGate
from .quota import Quota, redis_quota
from .redis_budget import RedisBudgetGate
from .scrape import EndpointScrapeGate
from .tier import TierPriorityAdmissionGate

GATE_TYPES: dict[str, Callable[[str, dict[str, Any], GateEnv | None], Gate]] = {
    cls.type_name: cls
    for cls in (
        ConstantGate,
        LocalMaxConcurrencyGate,
        GlobalMaxConcurrencyGate,
        RedisBudgetGate,
        RedisLeasedRateGate,
        CompositeGate,
        WaitOnRefuseGate,
        TierPriorityAdmissionGate,
        EndpointScrapeGate,
        PrometheusQueryGate,
        PrometheusSaturationGate,
        PrometheusBudgetGate,
    )
}
GATE_TYPES[Quota.type_name] = redis_quota  # a class per mode


def build_gate(
    gate_type: str | None, params: dict[str, Any] | None, *, name: str, env: GateEnv | None = None
) -> Gate:
    """Construct a gate from its config. Unknown types and bad params raise ConfigError.

    ``params`` may also be a JSON string holding an object. With ``env`` None the config is
    only validated: no Redis or network is touched.
    """
    gate_type = gate_type or "constant"
    make = GATE_TYPES.get(gate_type)
    if make is None:
        known = ", ".join(sorted(GATE_TYPES))
        raise ConfigError(f"unknown gate_type {gate_type!r} (known: {known})")
    if isinstance(params, str):
        try:
            params = json.loads(params) if params.strip() else {}
        except json.JSONDecodeError as exc:
            where = f"{gate_type} gate {name!r}"
            raise ConfigError(f"{where}: gate_params is not JSON: {exc}") from None
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{gate_type} gate {name!r}: gate_params must be an object")
    return make(name, dict(params or {}), env)
