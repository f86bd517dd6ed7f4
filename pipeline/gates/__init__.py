"""Gates: admission control in front of the model servers. See :mod:`pipeline.gates.base`.

The catalogue (``gate_type`` → class) is :data:`GATE_TYPES` (:mod:`.registry`);
:func:`build_gate` builds one from a queue's ``gate_type`` / ``gate_params`` and raises
ConfigError for unknown types and bad params of every type; it also builds the gates an
attempt of a queue passes and checks a whole configuration's gates. Imports ``config``,
``store`` and ``errors`` of the pipeline.
"""

from .base import (
    CONTINUE,
    AcquireContext,
    Admission,
    Batched,
    Budgeted,
    Calls,
    Decision,
    Gate,
    GateEnv,
    HandsOver,
    Settles,
    Verdict,
    dispatch_budget,
    settle,
    static_budget,
    wake_keys,
)
from .registry import (
    GATE_TYPES,
    attempt_gate,
    build_gate,
    check_gates,
    pool_gate,
    queue_gate,
    same_attempt_gate,
)

__all__ = [
    "CONTINUE",
    "GATE_TYPES",
    "AcquireContext",
    "Admission",
    "Batched",
    "Budgeted",
    "Calls",
    "Decision",
    "Gate",
    "GateEnv",
    "HandsOver",
    "Settles",
    "Verdict",
    "attempt_gate",
    "build_gate",
    "check_gates",
    "dispatch_budget",
    "pool_gate",
    "queue_gate",
    "same_attempt_gate",
    "settle",
    "static_budget",
    "wake_keys",
]
