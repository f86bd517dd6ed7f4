"""The events an attempt notes for its request's decision log, sent with the script call that
ends the attempt (docs/internals.md, "The decision log"). Text format: one event per line,
``<age in s>\\t<JSON object>``; the script stamps it ``now - age`` (lib.lua ``log_journal``).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

MAX_TEXT = 300  # characters kept of a free-text field (a reason, an error)


def entry(event: str, **fields: Any) -> dict[str, Any]:
    """A log entry without its time: ``{"e": event, ...}``, None fields left out, long text
    cut to :data:`MAX_TEXT` characters."""
    out: dict[str, Any] = {"e": event}
    for key, value in fields.items():
        if value is None or value == "":
            continue
        out[key] = value[:MAX_TEXT] if isinstance(value, str) else value
    return out


def _line(age: float, obj: dict[str, Any]) -> str:
    return f"{max(0.0, age):.3f}\t{json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}"


class Journal:
    """An attempt's events, oldest first, until they are sent (:meth:`take`). Thread-safe: a
    heartbeat or a bell may note while the attempt's thread sends."""

    def __init__(self) -> None:
        self._events: list[tuple[float, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def add(self, event: str, **fields: Any) -> None:
        self.append(entry(event, **fields))

    def append(self, obj: dict[str, Any]) -> None:
        """Note an entry made with :func:`entry` now."""
        with self._lock:
            self._events.append((time.monotonic(), obj))

    def take(self, last: dict[str, Any] | None = None) -> str:
        """The events not yet sent, plus ``last`` (now), as the scripts take them; they count
        as sent from now on."""
        now = time.monotonic()
        with self._lock:
            events, self._events = self._events, []
        lines = [_line(now - t, obj) for t, obj in events]
        if last is not None:
            lines.append(_line(0.0, last))
        return "\n".join(lines)
