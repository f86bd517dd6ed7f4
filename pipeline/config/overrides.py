"""Settings given in code (``pipeline.configure(**overrides)``, :func:`with_overrides`), checked
as their environment variables and files are: a bad one is a :class:`ConfigError` naming it
(``.field``), raised before anything is built."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from ..errors import ConfigError
from .load import parse_queues
from .merge import HEADER_NAME, MergePolicy, parse_merge_policy
from .settings import PoolConfig, QueueConfig, Settings

Check = Callable[[Any], str | None]  # what is wrong with a value, else None


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() else "must be a non-empty str"


def _header(value: Any) -> str | None:
    if isinstance(value, str) and (value == "" or HEADER_NAME.match(value)):
        return None
    return "must be an HTTP header name (or '' for none)"


def _seconds(least: float, strict: bool) -> Check:
    def check(value: Any) -> str | None:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value) and (value > least or (value == least and not strict)):
            return None
        return f"must be a number of seconds, {'more than ' if strict else 'at least '}{least:g}"

    return check


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


def _int(least: int) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and value >= least:
            return None
        return f"must be an int >= {least}"

    return check


def _master(value: Any) -> str | None:
    return None if value is None or _text(value) is None else "must be a name or None"


_CHECKS: dict[str, Check] = {
    "redis_url": _text,
    "broker_url": _text,
    "key_prefix": _text,
    "fairness_attribute": _text,
    "fairness_header": _header,
    "objective_header": _header,
    "redis_sentinel_master": _master,
    "lease_s": _seconds(0, strict=True),
    "dispatch_lease_s": _seconds(0, strict=True),
    "reaper_period_s": _seconds(0, strict=True),
    "result_ttl_s": _seconds(0, strict=True),
    "gate_wait_timeout_s": _seconds(0, strict=True),
    "wedge_after_s": _seconds(0, strict=True),
    "park_s": _seconds(0, strict=False),
    "direct_publish": _flag,
    "broker_acks": _flag,
    "allow_eviction": _flag,
    "max_payload_bytes": _int(1),
    "lookahead": _int(-1),
    "redis_min_replicas": _int(0),
    "redis_wait_timeout_ms": _int(1),
}


def _queues(value: Any) -> dict[str, QueueConfig]:
    if isinstance(value, list):
        return parse_queues(value, "configure: queues")
    if (
        isinstance(value, dict)
        and value
        and all(isinstance(q, QueueConfig) and q.queue_name == n for n, q in value.items())
    ):
        return value
    raise ConfigError(
        "configure: queues must be a list of queue entries (or a dict of QueueConfig by name)",
        field="queues",
    )


def _pools(value: Any) -> dict[str, PoolConfig]:
    if isinstance(value, list):
        pools = [
            PoolConfig.from_dict(e, f"configure: pool_configs #{i}") for i, e in enumerate(value)
        ]
        return {p.id: p for p in pools}
    if isinstance(value, dict) and all(
        isinstance(p, PoolConfig) and p.id == n for n, p in value.items()
    ):
        return value
    raise ConfigError(
        "configure: pool_configs must be a list of pool entries (or a dict of PoolConfig by id)",
        field="pool_configs",
    )


def _merge(value: Any) -> MergePolicy:
    if isinstance(value, MergePolicy):
        return value
    if isinstance(value, dict):
        return parse_merge_policy(value, "configure: merge_policy")
    raise ConfigError(
        "configure: merge_policy must be a MergePolicy or its file's object", field="merge_policy"
    )


_PARSED: dict[str, Callable[[Any], Any]] = {
    "queues": _queues,
    "pool_configs": _pools,
    "merge_policy": _merge,
}


def check_setting(name: str, value: Any) -> Any:
    """``value`` as the setting ``name`` holds it; ConfigError naming it (``.field``) for an
    unknown setting or a value its environment variable or file could not give."""
    if name in _PARSED:
        try:
            return _PARSED[name](value)
        except ConfigError as exc:
            raise ConfigError(str(exc), field=name) from None
    check = _CHECKS.get(name)
    if check is None:
        known = sorted(f.name for f in fields(Settings))
        raise ConfigError(
            f"configure: unknown setting {name!r} (settings: {', '.join(known)})", field=name
        )
    wrong = check(value)
    if wrong is not None:
        raise ConfigError(f"configure: {name} {wrong}, not {value!r:.200}", field=name)
    return value


def with_overrides(settings: Settings, **overrides: Any) -> Settings:
    """A copy of ``settings`` with some fields replaced, each checked (:func:`check_setting`;
    ``queues`` and ``pool_configs`` may be lists of file entries, ``merge_policy`` the file's
    object). Every queue must name one of ``pool_configs``, when there are any."""
    if not isinstance(settings, Settings):
        raise ConfigError("configure: settings must be a Settings", field="settings")
    out = replace(settings, **{n: check_setting(n, v) for n, v in overrides.items()})
    for q in out.queues.values() if out.pool_configs else ():
        if q.worker_pool_id not in out.pool_configs:
            raise ConfigError(
                f"configure: queue {q.queue_name!r} names worker_pool_id "
                f"{q.worker_pool_id!r}, which is not in pool_configs",
                field="queues" if "queues" in overrides else "pool_configs",
            )
    return out
