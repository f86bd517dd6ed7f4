"""Settings and queue configuration.

Queues use the reference's JSON field names (``queue_name``, ``igw_base_url``,
``request_path_url``, ``inference_objective``, ``worker_pool_id``, ``gate_type``,
``gate_params``, ``labels``, ``result_queue_name``) plus ours (``default_timeout_s``,
``request_timeout_s``, ``retry_base_delay_s``, ``retry_max_delay_s``). All durations are in
seconds.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError
from .keys import Keys

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_ENDPOINT = "http://127.0.0.1:8000"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_HEADER = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


@dataclass(frozen=True)
class QueueConfig:
    """One queue: where its requests go, how they are gated and retried."""

    queue_name: str
    igw_base_url: str
    id: str = ""
    request_path_url: str = "/v1/completions"
    inference_objective: str | None = None
    worker_pool_id: str = "default"
    gate_type: str = "constant"
    gate_params: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    result_queue_name: str | None = None
    default_timeout_s: float = 3600.0
    request_timeout_s: float = 300.0
    retry_base_delay_s: float = 2.0
    retry_max_delay_s: float = 60.0

    @property
    def queue_id(self) -> str:
        return self.id or self.queue_name

    @classmethod
    def from_dict(cls, entry: Any, where: str) -> QueueConfig:
        """Validate one queue entry; ``where`` names it in error messages."""
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: a queue entry must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
        name = entry.get("queue_name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{where}: queue_name must be 1-128 characters of [A-Za-z0-9_.-]")
        where = f"{where} ({name})"
        url = entry.get("igw_base_url")
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
            raise ConfigError(f"{where}: igw_base_url must be an http(s) URL")
        for key in ("gate_params", "labels"):
            if key in entry and not isinstance(entry[key], dict):
                raise ConfigError(f"{where}: {key} must be an object")
        pool = entry.get("worker_pool_id", "default")
        if not isinstance(pool, str) or not _NAME.match(pool):
            raise ConfigError(f"{where}: worker_pool_id must be a name")
        for key in (
            "default_timeout_s",
            "request_timeout_s",
            "retry_base_delay_s",
            "retry_max_delay_s",
        ):
            value = entry.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"{where}: {key} must be a positive number of seconds")
        try:
            return cls(**entry)
        except TypeError as exc:  # pragma: no cover - guarded by the checks above
            raise ConfigError(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class PoolConfig:
    """A worker pool (the reference's pool-config entry): a group of worker slots with its own
    Celery queue. ``workers`` caps the slots the dispatcher fills across all nodes; the gate,
    if any, is acquired together with the queue's gate just before the HTTP call."""

    id: str
    workers: int = 64
    gate_type: str | None = None
    gate_params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, entry: Any, where: str) -> PoolConfig:
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: a pool entry must be a JSON object")
        unknown = sorted(set(entry) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
        pid = entry.get("id")
        if not isinstance(pid, str) or not _NAME.match(pid):
            raise ConfigError(f"{where}: id must be 1-128 characters of [A-Za-z0-9_.-]")
        workers = entry.get("workers", 64)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
            raise ConfigError(f"{where} ({pid}): workers must be a positive int")
        params = entry.get("gate_params", {})
        if not isinstance(params, dict):
            raise ConfigError(f"{where} ({pid}): gate_params must be an object")
        return cls(pid, workers, entry.get("gate_type"), params)


@dataclass(frozen=True)
class Settings:
    """Process-wide settings. Read from the environment by :func:`load_settings`."""

    redis_url: str = DEFAULT_REDIS_URL
    broker_url: str = DEFAULT_REDIS_URL
    key_prefix: str = "pl:"
    queues: dict[str, QueueConfig] = field(default_factory=dict)
    pool_configs: dict[str, PoolConfig] = field(default_factory=dict)
    lease_s: float = 30.0
    dispatch_lease_s: float = 120.0
    reaper_period_s: float = 5.0
    result_ttl_s: float = 7 * 24 * 3600.0
    max_payload_bytes: int = 1024 * 1024
    gate_wait_timeout_s: float = 300.0
    fairness_attribute: str = "userid"  # metadata key sent as the fairness identity
    fairness_header: str = "x-llm-d-inference-fairness-id"  # "" disables the stamp
    wedge_after_s: float = 300.0  # no completion this long while full and waiting: wedged
    park_s: float = 10.0  # an attempt refused by a full slot gate parks this long for a release
    lookahead: int = -1  # attempts dispatched past a slot gate's capacity; -1: automatic
    direct_publish: bool = True  # the dispatch script pushes Celery messages (Redis broker)
    broker_acks: bool = False  # keep kombu's acks on a Redis broker (else consumed no_ack)

    def lookahead_for(self, capacity: int) -> int:
        """How many attempts the dispatcher sends past a slot gate of ``capacity``, to park
        at the workers so a released slot is taken at once: ``PIPELINE_LOOKAHEAD``, or by
        default a quarter of the capacity, at least 1 and at most 8 (none when parking is
        off)."""
        if self.park_s <= 0:
            return 0
        if self.lookahead >= 0:
            return self.lookahead
        return min(8, max(1, -(-capacity // 4)))

    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix)

    def queue(self, name: str) -> QueueConfig:
        return self.queues[name]

    def pools(self) -> dict[str, list[QueueConfig]]:
        """Worker pool id → the queues it serves."""
        out: dict[str, list[QueueConfig]] = {}
        for q in self.queues.values():
            out.setdefault(q.worker_pool_id, []).append(q)
        return out

    def result_list(self, queue: QueueConfig) -> str:
        return queue.result_queue_name or self.keys.default_result_list(queue.queue_name)


def parse_queues(data: Any, source: str) -> dict[str, QueueConfig]:
    """Validate a list of queue entries (the content of ``PIPELINE_QUEUES``)."""
    if isinstance(data, dict) and "queues" in data:
        data = data["queues"]
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{source}: expected a non-empty JSON list of queues")
    queues: dict[str, QueueConfig] = {}
    ids: set[str] = set()
    for i, entry in enumerate(data):
        q = QueueConfig.from_dict(entry, f"{source}: queue #{i}")
        if q.queue_name in queues:
            raise ConfigError(f"{source}: queue #{i}: duplicate queue_name {q.queue_name!r}")
        if q.queue_id in ids:
            raise ConfigError(f"{source}: queue #{i}: duplicate id {q.queue_id!r}")
        ids.add(q.queue_id)
        queues[q.queue_name] = q
    _check_gates(queues, source)
    return queues


def _check_gates(queues: dict[str, QueueConfig], source: str) -> None:
    from .gates import build_gate

    for q in queues.values():
        try:
            build_gate(q.gate_type, q.gate_params, name=q.queue_name)
        except ConfigError as exc:
            raise ConfigError(f"{source}: queue {q.queue_name!r}: {exc}") from None


def parse_pools(data: Any, source: str, queues: dict[str, QueueConfig]) -> dict[str, PoolConfig]:
    """Validate the pools file (``PIPELINE_POOLS``): ``[{id, workers, gate_type, gate_params}]``.
    Every queue's ``worker_pool_id`` must name one of them."""
    from .gates import build_gate

    if not isinstance(data, list) or not data:
        raise ConfigError(f"{source}: expected a non-empty JSON list of pools")
    pools: dict[str, PoolConfig] = {}
    for i, entry in enumerate(data):
        pool = PoolConfig.from_dict(entry, f"{source}: pool #{i}")
        if pool.id in pools:
            raise ConfigError(f"{source}: pool #{i}: duplicate id {pool.id!r}")
        if pool.gate_type:
            try:
                build_gate(pool.gate_type, pool.gate_params, name=f"pool.{pool.id}")
            except ConfigError as exc:
                raise ConfigError(f"{source}: pool {pool.id!r}: {exc}") from None
        pools[pool.id] = pool
    for q in queues.values():
        if q.worker_pool_id not in pools:
            raise ConfigError(
                f"{source}: queue {q.queue_name!r} names worker_pool_id "
                f"{q.worker_pool_id!r}, which is not in the pools file"
            )
    return pools


def _read_json(path: str, var: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ConfigError(f"{var}: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{var}: {path} is not valid JSON: {exc}") from None


def default_queues(endpoint: str) -> dict[str, QueueConfig]:
    return {"default": QueueConfig(queue_name="default", igw_base_url=endpoint)}


def _float_env(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, not {raw!r}") from None


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Settings from environment variables (``PIPELINE_*``, ``CELERY_BROKER_URL``)."""
    env = dict(os.environ if env is None else env)
    redis_url = env.get("PIPELINE_REDIS_URL") or DEFAULT_REDIS_URL
    path = env.get("PIPELINE_QUEUES")
    if path:
        queues = parse_queues(_read_json(path, "PIPELINE_QUEUES"), path)
    else:
        queues = default_queues(env.get("PIPELINE_ENDPOINT") or DEFAULT_ENDPOINT)
    pools_path = env.get("PIPELINE_POOLS")
    pools = (
        parse_pools(_read_json(pools_path, "PIPELINE_POOLS"), pools_path, queues)
        if (pools_path)
        else {}
    )
    header = env.get("PIPELINE_FAIRNESS_HEADER", "x-llm-d-inference-fairness-id")
    if header and not _HEADER.match(header):
        raise ConfigError(f"PIPELINE_FAIRNESS_HEADER: {header!r} is not a valid header name")
    return Settings(
        redis_url=redis_url,
        broker_url=env.get("CELERY_BROKER_URL") or redis_url,
        key_prefix=env.get("PIPELINE_KEY_PREFIX") or "pl:",
        queues=queues,
        pool_configs=pools,
        lease_s=_float_env(env, "PIPELINE_LEASE_S", 30.0),
        dispatch_lease_s=_float_env(env, "PIPELINE_DISPATCH_LEASE_S", 120.0),
        reaper_period_s=_float_env(env, "PIPELINE_REAPER_PERIOD_S", 5.0),
        result_ttl_s=_float_env(env, "PIPELINE_RESULT_TTL_S", 7 * 24 * 3600.0),
        max_payload_bytes=int(_float_env(env, "PIPELINE_MAX_PAYLOAD_BYTES", 1024 * 1024)),
        gate_wait_timeout_s=_float_env(env, "PIPELINE_GATE_WAIT_TIMEOUT_S", 300.0),
        fairness_attribute=env.get("PIPELINE_FAIRNESS_ATTRIBUTE", "userid"),
        fairness_header=env.get("PIPELINE_FAIRNESS_HEADER", "x-llm-d-inference-fairness-id"),
        wedge_after_s=_float_env(env, "PIPELINE_WEDGE_AFTER_S", 300.0),
        park_s=_float_env(env, "PIPELINE_PARK_S", 10.0),
        lookahead=_lookahead_env(env),
        direct_publish=bool_env(env, "PIPELINE_DIRECT_PUBLISH", True),
        broker_acks=bool_env(env, "PIPELINE_BROKER_ACKS", False),
    )


def bool_env(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A 1/0 (true/false, yes/no, on/off) environment variable; ConfigError otherwise."""
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be 1/0 (true/false), not {raw!r}")


def _lookahead_env(env: dict[str, str]) -> int:
    raw = env.get("PIPELINE_LOOKAHEAD", "")
    if raw in ("", "auto"):
        return -1
    if not raw.isdigit():
        raise ConfigError(f"PIPELINE_LOOKAHEAD must be 'auto' or an int >= 0, not {raw!r}")
    return int(raw)


def with_overrides(settings: Settings, **overrides: Any) -> Settings:
    """A copy of ``settings`` with some fields replaced; ``queues`` may be a list of dicts."""
    queues = overrides.get("queues")
    if isinstance(queues, list):
        overrides["queues"] = parse_queues(queues, "queues")
    return replace(settings, **overrides)
