"""Connections to Redis: the one function everything that talks to Redis goes through. A
``sentinel://`` list (Celery's syntax, :mod:`pipeline.config.redis_url`) is the master its
sentinels monitor, asked for on every connect (redis-py's ``SentinelConnectionPool``), so a
connection re-finds the master after a failover (docs/production.md, "Sentinel")."""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from ..config import MASTER_VAR, is_cluster, is_sentinel, parse_cluster_url, parse_sentinel_url
from ..errors import ConfigError

CONNECT_TIMEOUT_S = 5.0


def connect(
    url: str,
    *,
    sentinel_master: str | None = None,
    timeout: float | None = None,
    decode_responses: bool = True,
) -> redis.Redis:
    """A Redis client (decoded responses unless told otherwise) with keep-alive, a health
    check of idle connections and redis-py's retries. ``timeout`` (s) bounds connecting and
    every reply (default: connecting only, 5 s). ``sentinel_master``: the master's name, needed
    for a ``sentinel://`` URL (``PIPELINE_REDIS_SENTINEL_MASTER``). A ``redis+cluster://``
    URL gives redis-py's cluster client (it follows MOVED and ASK itself)."""
    options: dict[str, Any] = {
        "decode_responses": decode_responses,
        "socket_keepalive": True,
        "health_check_interval": 30,
        "socket_connect_timeout": CONNECT_TIMEOUT_S if timeout is None else timeout,
    }
    if timeout is not None:
        options["socket_timeout"] = timeout
    if is_cluster(url):
        seeds = parse_cluster_url(url)
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in seeds.nodes],
            username=seeds.username,
            password=seeds.password,
            ssl=seeds.tls,
            **options,
        )
        return cluster  # type: ignore[return-value]  # the commands the pipeline sends
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    if not sentinel_master:
        raise ConfigError(f"a sentinel:// URL needs the master's name: set {MASTER_VAR}")
    sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinels = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)
    return sentinels.master_for(
        sentinel_master,
        redis_class=redis.Redis,
        db=target.db,
        username=target.username,
        password=target.password,
        **options,
    )
