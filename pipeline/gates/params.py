"""Typed reads of ``gate_params`` (JSON numbers or strings, nested configs as objects or JSON
strings); every problem is a ConfigError naming the gate and the param."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError

_DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)"
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """Seconds from a number of seconds or a Go-style duration (``"1m"``, ``"1h30m"``,
    ``"500ms"``). Raises ValueError on anything else or a negative value."""
    if isinstance(value, bool):
        raise ValueError("a duration, not a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            if not re.fullmatch(f"(?:{_DURATION_PART})+", text):
                raise ValueError(f"a duration like '30s', '1m' or '500ms', not {text!r}") from None
            seconds = sum(float(n) * _UNIT_S[unit] for n, unit in re.findall(_DURATION_PART, text))
    else:
        raise ValueError(f"a duration, not {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a non-negative duration, not {value!r}")
    return seconds


class Params:
    """Reader over one gate's params; errors name ``gate_type``, the gate and the param."""

    def __init__(self, gate_type: str, name: str, params: Mapping[str, Any]) -> None:
        self.gate_type = gate_type
        self.name = name
        self.params = params

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.gate_type} gate {self.name!r}: param {key!r} {message}")

    def raw(self, key: str) -> Any:
        """The value, or None when absent, null or an empty string (all mean "default")."""
        value = self.params.get(key)
        if value is None or (isinstance(value, str) and value.strip() == ""):
            return None
        return value

    def has(self, key: str) -> bool:
        return self.raw(key) is not None

    def get_str(self, key: str, default: str | None = None, *, required: bool = False) -> str:
        """A string; numbers are accepted and formatted (``5`` → ``"5"``)."""
        value = self.raw(key)
        if value is None:
            if required or default is None:
                raise self.error(key, "is required")
            return default
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int | float):
            return f"{value:g}" if isinstance(value, float) else str(value)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, not {type(value).__name__}")
        return value

    def opt_str(self, key: str) -> str | None:
        return self.get_str(key) if self.has(key) else None

    def get_float(
        self,
        key: str,
        default: float | None = None,
        *,
        lo: float | None = None,
        hi: float | None = None,
        lo_open: bool = False,
        hi_open: bool = False,
    ) -> float:
        """A finite number (JSON number or numeric string) in [lo, hi] (or open bounds)."""
        value = self.raw(key)
        if value is None:
            if default is None:
                raise self.error(key, "is required")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise self.error(key, f"must be a number, not {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise self.error(key, f"must be a number, not {value!r}") from None
        if not math.isfinite(number):
            raise self.error(key, f"must be a finite number, not {value!r}")
        low_bad = lo is not None and (number <= lo if lo_open else number < lo)
        high_bad = hi is not None and (number >= hi if hi_open else number > hi)
        if low_bad or high_bad:
            left = "(" if lo_open else "["
            right = ")" if hi_open else "]"
            lo_s = "-inf" if lo is None else f"{lo:g}"
            hi_s = "inf" if hi is None else f"{hi:g}"
            raise self.error(key, f"must be in {left}{lo_s}, {hi_s}{right}, not {number:g}")
        return number

    def get_int(self, key: str, default: int | None = None, *, lo: int | None = None) -> int:
        """An integer (a JSON number without a fraction or an integer string), at least ``lo``."""
        number = self.get_float(key, None if default is None else float(default), lo=lo)
        if not number.is_integer():
            raise self.error(key, f"must be an integer, not {self.raw(key)!r}")
        return int(number)

    def get_choice(self, key: str, choices: Sequence[str], default: str) -> str:
        value = self.get_str(key, default)
        if value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}; not {value!r}")
        return value

    def get_duration(self, key: str, default: float) -> float:
        """Seconds, from a number of seconds or a string like ``"1m"``, ``"30s"``, ``"500ms"``."""
        value = self.raw(key)
        if value is None:
            return default
        try:
            return parse_duration(value)
        except ValueError as exc:
            raise self.error(key, f"must be {exc}") from None

    def get_str_map(self, key: str) -> dict[str, str]:
        """A label map: a JSON object, or a string holding one. Values become strings."""
        value = self.get_object(key, "must be an object of label names to values")
        return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in value.items()}

    def get_object(self, key: str, problem: str = "must be an object") -> dict[str, Any]:
        """A JSON object, or a string holding one (``{}`` when absent)."""
        value = self._json(key, self.raw(key))
        if value is not None and not isinstance(value, dict):
            raise self.error(key, problem)
        return value or {}

    def gate_config(self, key: str) -> tuple[str, dict[str, Any]]:
        """One nested ``{"gate_type": ..., "gate_params": {...}}`` (object or JSON string)."""
        value = self._json(key, self.raw(key))
        if value is None:
            raise self.error(key, "is required: an object with gate_type and gate_params")
        return self._one_config(key, value)

    def gate_configs(self, key: str) -> list[tuple[str, dict[str, Any]]]:
        """A non-empty list of nested gate configs (array or JSON string)."""
        value = self._json(key, self.raw(key))
        if value is None:
            raise self.error(key, "is required: a list of {gate_type, gate_params} objects")
        if not isinstance(value, list):
            raise self.error(key, "must be a list of {gate_type, gate_params} objects")
        if not value:
            raise self.error(key, "must name at least one gate")
        return [self._one_config(f"{key}[{i}]", item) for i, item in enumerate(value)]

    def _json(self, key: str, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise self.error(key, f"is not valid JSON: {exc}") from None
        return value

    def _one_config(self, key: str, value: Any) -> tuple[str, dict[str, Any]]:
        value = self._json(key, value)
        if not isinstance(value, dict):
            raise self.error(key, "must be an object with gate_type and gate_params")
        gate_type = value.get("gate_type")
        if not isinstance(gate_type, str) or not gate_type:
            raise self.error(key, "needs a gate_type")
        inner = self._json(f"{key}.gate_params", value.get("gate_params"))
        if inner is None:
            inner = {}
        if not isinstance(inner, dict):
            raise self.error(f"{key}.gate_params", "must be an object")
        return gate_type, inner
