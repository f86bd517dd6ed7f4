"""Reading settings from ``PIPELINE_*`` variables and the queue and pool files, validated field
by field; gate parameters are checked by the gates (``pipeline.gates.check_gates``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .merge import HEADER_NAME, MergePolicy, parse_merge_policy
from .redis_url import MASTER_VAR, check_redis_url, check_sentinel, is_cluster
from .settings import (
    DEFAULT_ENDPOINT,
    DEFAULT_KEY_PREFIX,
    DEFAULT_REDIS_URL,
    PoolConfig,
    QueueConfig,
    Settings,
)


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
    return queues


def parse_pools(data: Any, source: str, queues: dict[str, QueueConfig]) -> dict[str, PoolConfig]:
    """Validate the pools file (``PIPELINE_POOLS``): ``[{id, workers, gate_type, gate_params}]``.
    Every queue's ``worker_pool_id`` must name one of them."""
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{source}: expected a non-empty JSON list of pools")
    pools: dict[str, PoolConfig] = {}
    for i, entry in enumerate(data):
        pool = PoolConfig.from_dict(entry, f"{source}: pool #{i}")
        if pool.id in pools:
            raise ConfigError(f"{source}: pool #{i}: duplicate id {pool.id!r}")
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


def read_queue_files(
    env: Mapping[str, str],
) -> tuple[dict[str, QueueConfig], dict[str, PoolConfig]]:
    """The queues of ``PIPELINE_QUEUES`` (else ``default`` at ``PIPELINE_ENDPOINT``) and the
    pools of ``PIPELINE_POOLS``; ConfigError naming the file, entry and field."""
    path = env.get("PIPELINE_QUEUES")
    if path:
        queues = parse_queues(_read_json(path, "PIPELINE_QUEUES"), path)
    else:
        endpoint = env.get("PIPELINE_ENDPOINT") or DEFAULT_ENDPOINT
        queues = {"default": QueueConfig(queue_name="default", igw_base_url=endpoint)}
    path = env.get("PIPELINE_POOLS")
    pools = parse_pools(_read_json(path, "PIPELINE_POOLS"), path, queues) if path else {}
    return queues, pools


def float_env(
    env: Mapping[str, str],
    name: str,
    default: float,
    *,
    above: float | None = None,
    at_least: float | None = None,
) -> float:
    """``env[name]`` as a finite number (``default`` when unset or empty), ``> above`` and
    ``>= at_least`` when given; a ConfigError names the variable."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a number, not {raw!r}") from None
    if above is not None and not value > above:
        raise ConfigError(f"{name} must be a number > {above:g}, not {raw!r}")
    if at_least is not None and not value >= at_least:
        raise ConfigError(f"{name} must be a number >= {at_least:g}, not {raw!r}")
    return value


def key_prefix(env: Mapping[str, str] | None = None) -> str:
    """``PIPELINE_KEY_PREFIX`` (default ``pl:``): read here only, for the settings, the Celery
    queue names (celeryconfig.py, tasks/app.py) and the key builders."""
    env = os.environ if env is None else env
    return env.get("PIPELINE_KEY_PREFIX") or DEFAULT_KEY_PREFIX


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Settings from environment variables (``PIPELINE_*``, ``CELERY_BROKER_URL``)."""
    env = dict(os.environ if env is None else env)
    redis_url = env.get("PIPELINE_REDIS_URL") or DEFAULT_REDIS_URL
    queues, pools = read_queue_files(env)
    master = env.get(MASTER_VAR) or None
    for var in ("PIPELINE_REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        check_sentinel(env.get(var) or "", var, master)
    check_redis_url(redis_url)  # a scheme, port and database it can use; the message redacted
    broker = env.get("CELERY_BROKER_URL")
    if is_cluster(redis_url) and (not broker or is_cluster(broker)):
        raise ConfigError(
            "PIPELINE_REDIS_URL names a Redis Cluster, which Celery cannot use as its "
            "broker: set CELERY_BROKER_URL to RabbitMQ (amqp://...) or a standalone Redis"
        )
    fairness_header = env.get("PIPELINE_FAIRNESS_HEADER", "x-llm-d-inference-fairness-id")
    objective_header = env.get("PIPELINE_OBJECTIVE_HEADER", "x-llm-d-inference-objective")
    for var, header in (
        ("PIPELINE_FAIRNESS_HEADER", fairness_header),
        ("PIPELINE_OBJECTIVE_HEADER", objective_header),
    ):
        if header and not HEADER_NAME.match(header):
            raise ConfigError(f"{var}: {header!r} is not a valid header name")
    path = env.get("PIPELINE_MERGE_POLICY")
    merge = MergePolicy()
    if path:
        data = _read_json(path, "PIPELINE_MERGE_POLICY")
        merge = parse_merge_policy(data, f"PIPELINE_MERGE_POLICY ({path})")
    if merge.fairness_header is not None:  # the reference's parameter wins
        fairness_header = merge.fairness_header
    attribute = merge.fairness_attribute or env.get("PIPELINE_FAIRNESS_ATTRIBUTE", "userid")
    return Settings(
        redis_url=redis_url,
        broker_url=env.get("CELERY_BROKER_URL") or redis_url,
        key_prefix=key_prefix(env),
        queues=queues,
        pool_configs=pools,
        lease_s=float_env(env, "PIPELINE_LEASE_S", 30.0, above=0),
        dispatch_lease_s=float_env(env, "PIPELINE_DISPATCH_LEASE_S", 120.0, above=0),
        reaper_period_s=float_env(env, "PIPELINE_REAPER_PERIOD_S", 5.0, above=0),
        result_ttl_s=float_env(env, "PIPELINE_RESULT_TTL_S", 7 * 24 * 3600.0, above=0),
        max_payload_bytes=int(
            float_env(env, "PIPELINE_MAX_PAYLOAD_BYTES", 1024 * 1024, at_least=1)
        ),
        body_inline_max=_int_env(env, "PIPELINE_BODY_INLINE_MAX", 64 * 1024, lo=0),
        gate_wait_timeout_s=float_env(env, "PIPELINE_GATE_WAIT_TIMEOUT_S", 300.0, at_least=0),
        fairness_attribute=attribute.removeprefix("metadata."),
        fairness_header=fairness_header,
        objective_header=objective_header,
        wedge_after_s=float_env(env, "PIPELINE_WEDGE_AFTER_S", 300.0, above=0),
        park_s=float_env(env, "PIPELINE_PARK_S", 10.0, at_least=0),
        lookahead=_lookahead_env(env),
        direct_publish=bool_env(env, "PIPELINE_DIRECT_PUBLISH", True),
        broker_acks=bool_env(env, "PIPELINE_BROKER_ACKS", False),
        redis_sentinel_master=master,
        redis_min_replicas=_int_env(env, "PIPELINE_REDIS_MIN_REPLICAS", 0, lo=0),
        redis_wait_timeout_ms=_int_env(env, "PIPELINE_REDIS_WAIT_TIMEOUT_MS", 1000, lo=1),
        allow_eviction=bool_env(env, "PIPELINE_ALLOW_EVICTION", False),
        redis_connections=_int_env(env, "PIPELINE_REDIS_CONNECTIONS", 24, lo=1),
        merge_policy=merge,
    )


def _int_env(env: Mapping[str, str], name: str, default: int, *, lo: int) -> int:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    if not raw.isdigit() or int(raw) < lo:
        raise ConfigError(f"{name} must be an int >= {lo}, not {raw!r}")
    return int(raw)


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


def _lookahead_env(env: Mapping[str, str]) -> int:
    raw = env.get("PIPELINE_LOOKAHEAD", "")
    if raw in ("", "auto"):
        return -1
    if not raw.isdigit():
        raise ConfigError(f"PIPELINE_LOOKAHEAD must be 'auto' or an int >= 0, not {raw!r}")
    return int(raw)
