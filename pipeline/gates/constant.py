"""``constant``: always open, budget 1.0 (the default when a queue names no gate)."""

from __future__ import annotations

from .base import Gate


class ConstantGate(Gate):
    type_name = "constant"
