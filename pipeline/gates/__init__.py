"""Gates: admission control in front of the model servers. See :mod:`pipeline.gates.base`."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import CONTINUE, AcquireContext, Decision, Gate, GateEnv, Verdict
from .constant import ConstantGate

GATE_TYPES: dict[str, type[Gate]] = {
    ConstantGate.type_name: ConstantGate,
}


def build_gate(
    gate_type: str | None, params: dict[str, Any] | None, *, name: str, env: GateEnv | None = None
) -> Gate:
    """Construct a gate from its config. Unknown types and bad params raise ConfigError."""
    gate_type = gate_type or "constant"
    cls = GATE_TYPES.get(gate_type)
    if cls is None:
        known = ", ".join(sorted(GATE_TYPES))
        raise ConfigError(f"unknown gate_type {gate_type!r} (known: {known})")
    return cls(name, dict(params or {}), env)


__all__ = [
    "CONTINUE",
    "GATE_TYPES",
    "AcquireContext",
    "Decision",
    "Gate",
    "GateEnv",
    "Verdict",
    "build_gate",
]
