"""The gate catalogue (:data:`GATE_TYPES`), :func:`build_gate`, the chain an attempt passes (its
queue's gate, then its pool's) and the check of a whole configuration's gates."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from redis.crc import key_slot

from ..config import Settings
from ..errors import ConfigError
from .adaptive import AdaptiveConcurrencyGate
from .base import Gate, GateEnv, walk
from .composite import Build, CompositeGate, WaitOnRefuseGate
from .leased_rate import RedisLeasedRateGate
from .local import GlobalMaxConcurrencyGate, LocalMaxConcurrencyGate
from .metric import PrometheusBudgetGate, PrometheusQueryGate, PrometheusSaturationGate
from .quota import Quota, redis_quota
from .redis_budget import RedisBudgetGate
from .scrape import EndpointScrapeGate
from .tier import TierPriorityAdmissionGate


class ConstantGate(Gate):
    """``constant``: always open, budget 1.0 (the default when a queue names no gate)."""

    type_name = "constant"


Make = Callable[[str, dict[str, Any], GateEnv | None], Gate]


def nesting(cls: Callable[[str, dict[str, Any], GateEnv | None, Build], Gate]) -> Make:
    """A gate made of other gates, built with :func:`build_gate` (its module cannot import
    this one, which imports it: the catalogue hands itself in)."""
    return lambda name, params, env: cls(name, params, env, build_gate)


GATE_TYPES: dict[str, Make] = {
    cls.type_name: cls
    for cls in (
        ConstantGate,
        LocalMaxConcurrencyGate,
        GlobalMaxConcurrencyGate,
        AdaptiveConcurrencyGate,
        RedisBudgetGate,
        RedisLeasedRateGate,
        EndpointScrapeGate,
        PrometheusQueryGate,
        PrometheusSaturationGate,
        PrometheusBudgetGate,
    )
}
for _nested in (CompositeGate, WaitOnRefuseGate, TierPriorityAdmissionGate):
    GATE_TYPES[_nested.type_name] = nesting(_nested)
GATE_TYPES[Quota.type_name] = redis_quota  # a class per mode


def build_gate(
    gate_type: str | None, params: dict[str, Any] | None, *, name: str, env: GateEnv | None = None
) -> Gate:
    """A gate from its config (``params`` may be a JSON string); ConfigError for an unknown
    type or bad params. With ``env`` None it is only validated: nothing is connected to."""
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


def queue_gate(settings: Settings, queue: str, env: GateEnv | None) -> Gate:
    q = settings.queues[queue]
    return build_gate(q.gate_type, q.gate_params, name=queue, env=env)


def pool_gate(settings: Settings, pool: str, env: GateEnv | None) -> Gate | None:
    cfg = settings.pool_configs.get(pool)
    if cfg is None or not cfg.gate_type:
        return None
    return build_gate(cfg.gate_type, cfg.gate_params, name=f"pool.{pool}", env=env)


def attempt_gate(
    settings: Settings, queue: str, env: GateEnv | None, pools: dict[str, Gate | None] | None = None
) -> Gate:
    """The queue's gate, chained with its pool's (``pools``: one instance per pool)."""
    gate = queue_gate(settings, queue, env)
    pool = settings.queues[queue].worker_pool_id
    if pools is None:
        pools = {}
    if pool not in pools:
        pools[pool] = pool_gate(settings, pool, env)
    pg = pools[pool]
    if pg is None:
        return gate
    return CompositeGate.of(f"{queue}+pool.{pool}", [gate, pg], env)


def same_attempt_gate(old: Settings, new: Settings, queue: str) -> bool:
    """Whether ``queue``'s attempt gate is configured the same in both (a reload keeps it)."""
    a, b = old.queues.get(queue), new.queues.get(queue)
    if a is None or b is None:
        return False
    return (a.gate_type, a.gate_params, a.worker_pool_id) == (
        b.gate_type,
        b.gate_params,
        b.worker_pool_id,
    ) and old.pool_configs.get(a.worker_pool_id) == new.pool_configs.get(b.worker_pool_id)


def check_cluster(settings: Settings) -> None:
    """On a Redis Cluster each pool's keys are in one slot: refuse (ConfigError naming the
    queue and the fix) what would make a script touch keys of two slots, or count one limit
    separately per pool."""
    shared: dict[str, str] = {}  # a redis-quota key's prefix -> the pool counting it
    for q in settings.queues.values():
        pool, where = q.worker_pool_id, f"queue {q.queue_name!r} on a Redis Cluster"
        tag = f"{{p:{pool}}}"

        def in_slot(key: str, tag: str = tag) -> bool:
            return key_slot(key.encode()) == key_slot(tag.encode())

        if q.ingest:
            raise ConfigError(f"{where}: ingest from llm-d-async producers is not supported "
                              "(their keys carry no pool's hash tag)")  # fmt: skip
        if not in_slot(q.result_queue_name or tag):
            raise ConfigError(f"{where}: result_queue_name {q.result_queue_name!r} must be "
                              f"in its pool's slot: put {tag} in the name")  # fmt: skip
        for g in walk(attempt_gate(settings, q.queue_name, None)):
            key = g.quota_key("") if isinstance(g, Quota) else None
            if key is not None and shared.setdefault(key, pool) != pool:
                raise ConfigError(f"{where}: redis-quota keys {key}* are shared with pool "
                                  f"{shared[key]!r}; give each pool its own prefix")  # fmt: skip
            if isinstance(g, RedisLeasedRateGate) and not in_slot(g.control_key):
                raise ConfigError(f"{where}: redis-leased-rate control_key "
                                  f"{g.control_key!r} must carry {tag}")  # fmt: skip


def check_gates(settings: Settings) -> Settings:
    """Validate every queue's and pool's gate (ConfigError naming it), and on a Redis Cluster
    what crosses pools (:func:`check_cluster`); returns ``settings``."""
    for q in settings.queues.values():
        try:
            queue_gate(settings, q.queue_name, None)
        except ConfigError as exc:
            raise ConfigError(f"queue {q.queue_name!r}: {exc}") from None
    for pool in settings.pool_configs:
        try:
            pool_gate(settings, pool, None)
        except ConfigError as exc:
            raise ConfigError(f"pool {pool!r}: {exc}") from None
    if settings.redis_cluster:
        check_cluster(settings)
    return settings
