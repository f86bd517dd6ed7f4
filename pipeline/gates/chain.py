"""Which gates an attempt of a queue passes: the queue's own gate, then its worker pool's gate
(``PIPELINE_POOLS``), acquired all-or-nothing as one chain just before the HTTP call. Also
where a configuration's gates are checked (:func:`check_gates`): the settings are plain data,
so a bad ``gate_type`` or ``gate_params`` is found here, by the gates themselves."""

from __future__ import annotations

from ..config import Settings
from ..errors import ConfigError
from .base import Gate, GateEnv
from .composite import CompositeGate
from .registry import build_gate


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
    """The queue's gate, chained with its pool's gate when the pool has one. ``pools`` caches
    pool gates so every queue of a pool shares one instance."""
    gate = queue_gate(settings, queue, env)
    pool = settings.queues[queue].worker_pool_id
    if pools is not None and pool in pools:
        pg = pools[pool]
    else:
        pg = pool_gate(settings, pool, env)
        if pools is not None:
            pools[pool] = pg
    if pg is None:
        return gate
    return CompositeGate.of(f"{queue}+pool.{pool}", [gate, pg], env)


def same_attempt_gate(old: Settings, new: Settings, queue: str) -> bool:
    """Whether ``queue``'s attempt gate (its own and its pool's) is configured the same in
    both: a reload keeps that gate (and its reservations' keys) as it is."""
    a, b = old.queues.get(queue), new.queues.get(queue)
    if a is None or b is None:
        return False
    return (a.gate_type, a.gate_params, a.worker_pool_id) == (
        b.gate_type,
        b.gate_params,
        b.worker_pool_id,
    ) and old.pool_configs.get(a.worker_pool_id) == new.pool_configs.get(b.worker_pool_id)


def check_gates(settings: Settings) -> Settings:
    """Validate every queue's and pool's gate (type and params; nothing is connected to):
    ConfigError naming the queue or pool. Returns ``settings``."""
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
    return settings
