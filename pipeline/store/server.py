"""The Redis server's memory, eviction policy and persistence (``pipeline status``), and the
worker's refusal of a Redis that may evict keys (docs/production.md, "No eviction") or is a
Redis Cluster node; ``INFO`` first (managed services allow it), ``CONFIG GET`` only for what it
does not say."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from ..errors import UnsafeRedis

log = logging.getLogger("pipeline.store")

SAFE_POLICY = "noeviction"
ALLOW_VAR = "PIPELINE_ALLOW_EVICTION"


@dataclass(frozen=True)
class ServerFacts:
    """Memory and persistence of a Redis server. ``None``: the server did not say (a command
    refused or renamed)."""

    used_memory: int | None = None  # bytes
    maxmemory: int | None = None  # bytes; 0 = no limit
    maxmemory_policy: str | None = None
    aof_enabled: bool | None = None
    rdb_last_save: float | None = None  # Unix s of the last successful RDB save
    rdb_changes_since_save: int | None = None
    rdb_save: str | None = None  # the `save` setting ('' = RDB snapshots off), CONFIG GET
    problem: str | None = None  # why some facts are missing
    server_time: float | None = None  # the server's clock (Unix s) when they were read
    cluster_enabled: bool | None = None  # a Redis Cluster node (INFO cluster)


def _int(info: dict[str, Any], key: str) -> int | None:
    try:
        return int(info[key])
    except (KeyError, TypeError, ValueError):
        return None


def _config_get(client: redis.Redis, name: str) -> str | None:
    reply = client.config_get(name)
    value = reply.get(name) if isinstance(reply, dict) else None  # decoded (the Store's client)
    return None if value is None else str(value)


def server_facts(client: redis.Redis) -> ServerFacts:
    """Read ``INFO memory`` and ``INFO persistence`` (one round trip), then ``CONFIG GET`` for
    what INFO lacks (the policy on a Redis older than 4, the ``save`` setting). A refused
    command leaves its facts ``None`` and says why in ``problem``; a server that does not
    answer at all raises ``redis.RedisError``."""
    problems: list[str] = []
    info: dict[str, Any] = {}
    with client.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.info("memory")
        pipe.info("persistence")
        pipe.info("cluster")
        clock, memory, persistence, cluster = pipe.execute(raise_on_error=False)
    for reply in (clock, memory, persistence, cluster):
        if isinstance(reply, Exception) and not isinstance(reply, redis.ResponseError):
            raise reply  # the server does not answer
    for section in (memory, persistence):
        if isinstance(section, redis.ResponseError):  # INFO renamed or denied
            problems.append(f"INFO refused ({section})")
            break
        info.update(section)
    now = None if isinstance(clock, Exception) else clock[0] + clock[1] / 1e6
    policy = info.get("maxmemory_policy")
    maxmemory = _int(info, "maxmemory")
    save: str | None = None
    try:
        if policy is None:
            policy = _config_get(client, "maxmemory-policy")
        if maxmemory is None:
            raw = _config_get(client, "maxmemory")
            maxmemory = int(raw) if raw is not None and raw.isdigit() else None
        save = _config_get(client, "save")
    except redis.ResponseError as exc:  # CONFIG renamed or denied (managed Redis)
        problems.append(f"CONFIG GET refused ({exc})")
    aof = _int(info, "aof_enabled")
    on_cluster = None if isinstance(cluster, Exception) else _int(cluster, "cluster_enabled")
    return ServerFacts(
        server_time=now,
        used_memory=_int(info, "used_memory"),
        maxmemory=maxmemory,
        maxmemory_policy=str(policy) if policy is not None else None,
        aof_enabled=None if aof is None else aof == 1,
        rdb_last_save=_int(info, "rdb_last_save_time"),
        rdb_changes_since_save=_int(info, "rdb_changes_since_last_save"),
        rdb_save=save,
        problem="; ".join(problems) or None,
        cluster_enabled=None if on_cluster is None else on_cluster == 1,
    )


SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


@dataclass(frozen=True)
class ShardLoad:
    """How busy one Redis server is: what an operator compares across a cluster's primaries to
    find a hot shard."""

    ops_per_sec: int | None  # INFO stats instantaneous_ops_per_sec
    script_seconds: float | None  # time spent in scripts since the server started
    used_memory: int | None  # bytes


def primaries(client: redis.Redis) -> list[tuple[str, redis.Redis]]:
    """(name, client) of each server holding the pipeline's keys: ``client``'s one, or every
    primary of a Redis Cluster (``host:port``)."""
    if not isinstance(client, RedisCluster):
        return [("redis", client)]
    return [(n.name, n.redis_connection) for n in client.get_primaries()]


def shard_load(client: redis.Redis) -> ShardLoad:
    """One server's load (one round trip); a field it refuses to tell is None."""
    with client.pipeline(transaction=False) as pipe:
        for section in ("stats", "commandstats", "memory"):
            pipe.info(section)
        stats, commands, memory = pipe.execute(raise_on_error=False)
    ok = [r if isinstance(r, dict) else None for r in (stats, commands, memory)]
    script = None
    if ok[1] is not None:
        usec = sum(ok[1].get(f"cmdstat_{c}", {}).get("usec", 0) for c in SCRIPT_COMMANDS)
        script = usec / 1e6
    return ShardLoad(
        _int(ok[0] or {}, "instantaneous_ops_per_sec"), script, _int(ok[2] or {}, "used_memory")
    )


def check_redis(
    client: redis.Redis, where: str, *, allow: bool, in_cluster: bool = False
) -> ServerFacts | None:
    """Refuse a Redis Cluster node named as a standalone Redis (:class:`UnsafeRedis`: its keys
    would lack their pool's hash tag) and a Redis that may evict keys (:class:`UnsafeRedis`
    naming ``maxmemory-policy``, the value found and the fix), unless ``allow``
    (``PIPELINE_ALLOW_EVICTION=1``: a warning instead). A policy nobody would tell (INFO and
    CONFIG refused) is a warning too, and so is a server that does not answer (the node starts
    and reconnects as usual): the facts read, or None then. ``where`` names the server (a
    redacted URL) in the messages. On a cluster (``redis+cluster://``) each primary is checked."""
    if isinstance(client, RedisCluster):  # each primary holds some pools' keys
        checked = [
            check_redis(node, f"{where} ({name})", allow=allow, in_cluster=True)
            for name, node in primaries(client)
        ]
        return next(iter(checked), None)
    try:
        facts = server_facts(client)
    except (redis.RedisError, OSError) as exc:
        log.warning(
            "could not read maxmemory-policy of the Redis at %s (%s): it must be %s",
            where,
            type(exc).__name__,
            SAFE_POLICY,
        )
        return None
    if facts.cluster_enabled and not in_cluster:
        raise UnsafeRedis(
            f"the Redis at {where} is a Redis Cluster node (cluster_enabled:1) named as a "
            "standalone Redis: name the cluster instead, PIPELINE_REDIS_URL="
            'redis+cluster://host:port[,host:port...] (docs/production.md, "Redis Cluster")'
        )
    policy = facts.maxmemory_policy
    if policy is None:
        log.warning(
            "could not read maxmemory-policy of the Redis at %s (%s): make sure it is %s, "
            "or keys the pipeline needs may be evicted",
            where,
            facts.problem,
            SAFE_POLICY,
        )
    elif policy != SAFE_POLICY and not allow:
        raise UnsafeRedis(
            f"the Redis at {where} has maxmemory-policy {policy}: it may evict the pipeline's "
            f"leases, requests and queue entries. Set maxmemory-policy {SAFE_POLICY} "
            f"(redis.conf, or CONFIG SET maxmemory-policy {SAFE_POLICY}), "
            f"or set {ALLOW_VAR}=1 to run anyway"
        )
    elif policy != SAFE_POLICY:
        log.warning(
            "%s=1: running on the Redis at %s with maxmemory-policy %s, which may evict the "
            "pipeline's leases, requests and queue entries (set it to %s)",
            ALLOW_VAR,
            where,
            policy,
            SAFE_POLICY,
        )
    return facts
