"""``redis``: the budget is a number another system writes into a Redis key; and
:class:`OnRedis`, the client of a gate that may name its own Redis."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis

from ..config import is_sentinel, parse_sentinel_url
from ..errors import ConfigError
from ..redact import redact_url
from ..store import connect as store_connect
from .base import Budgeted, Gate, GateEnv, note_problem
from .params import Params

log = logging.getLogger(__name__)

_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class RedisAddress:
    """A gate's own Redis: its URL, and the master's name when the URL lists sentinels."""

    url: str
    master_name: str | None = None


def redis_url(p: Params, key: str = "address") -> RedisAddress | None:
    """The ``address`` param as a Redis URL (``host:port`` gets ``redis://``), or None."""
    address = p.opt_str(key)
    if address is None:
        return None
    if is_sentinel(address):
        try:
            parse_sentinel_url(address, key)
        except ConfigError as exc:
            raise p.error(key, f"is not a Sentinel list ({exc})") from None
        master = p.opt_str("master_name")
        if not master:
            raise p.error("master_name", "is required with a sentinel:// address")
        return RedisAddress(address, master)
    url = address if "://" in address else f"redis://{address}"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a malformed port
    except ValueError as exc:
        raise p.error(key, f"is not a Redis URL or host:port ({exc})") from None
    if parts.scheme not in _SCHEMES or (parts.scheme != "unix" and not parts.hostname):
        raise p.error(key, "must be a redis:// URL, host:port or a sentinel:// list")
    return RedisAddress(url)


class OnRedis(Gate):
    """A gate on the Redis its ``address`` names (a client of its own, 5 s timeouts), else the
    pipeline's."""

    client: redis.Redis | None

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        url = self.url = redis_url(Params(self.type_name, name, params))
        if env is None or url is None:
            self.client = None if env is None else env.client
        else:
            self.client = store_connect(url.url, sentinel_master=url.master_name, timeout=5)

    def close(self) -> None:
        if self.url is not None and self.client is not None:
            self.client.close()


class RedisBudgetGate(Budgeted, OnRedis):
    type_name = "redis"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        self.budget_key = p.get_str("budget_key", "dispatch-gate-budget")
        self._last_problem: str | None = None

    def budget(self) -> float:
        """The key's value clamped to [0, 1]; 1.0 when missing; 0.0 on any error."""
        try:
            if self.client is None:
                raise RuntimeError("gate is not bound to Redis")
            raw = self.client.get(self.budget_key)
        except Exception as exc:  # noqa: BLE001 - budget() never raises; fail closed
            return self._problem(f"cannot read {self.budget_key!r}: {exc}")
        try:
            value = 1.0 if raw is None else float(raw)
        except (TypeError, ValueError):
            value = math.nan
        if math.isnan(value):
            return self._problem(f"{self.budget_key!r} holds {str(raw)[:40]!r}, not a number")
        self._problem(None)
        return min(1.0, max(0.0, value))

    def _problem(self, problem: str | None) -> float:
        where = redact_url(self.url.url) if self.url else "the pipeline's Redis"
        self._last_problem = note_problem(self, self._last_problem, problem, f"budget 0 ({where})")
        return 0.0

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "budget_key": self.budget_key, "budget": self.budget()}
