"""Connections to Redis: the one function everything that talks to Redis goes through. A
``sentinel://`` list (Celery's syntax, :mod:`pipeline.config.redis_url`) is the master its
sentinels monitor, asked for on every connect (redis-py's ``SentinelConnectionPool``), so a
connection re-finds the master after a failover (docs/production.md, "Sentinel").

A client's connections are bounded whatever the number of threads using it: script calls
borrow from the process's :class:`~.scripts.Lanes` (``PIPELINE_REDIS_CONNECTIONS``), and
redis-py's own pool (plain commands, Pub/Sub listeners, the dispatcher's doorbell wait) is a
blocking one of at most :data:`CLIENT_POOL` connections, where a thread waits for a connection
instead of raising ``MaxConnectionsError`` (docs/internals.md, "Script calls")."""

from __future__ import annotations

import errno
import socket
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel, SentinelConnectionPool

from ..config import MASTER_VAR, is_cluster, is_sentinel, parse_cluster_url, parse_sentinel_url
from ..errors import ConfigError, RedisUnavailable
from .scripts import close_lanes, set_lanes

CONNECT_TIMEOUT_S = 5.0
CLIENT_POOL = 16  # redis-py's own connections per client, beside its Lanes
POOL_WAIT_S = 30.0  # a thread waits this long for one of them (then ConnectionError)


class Client(redis.Redis):
    """redis-py's client; :meth:`close` also disconnects its script-call connections (its
    :class:`~.scripts.Lanes`, outside its redis-py pool)."""

    def close(self) -> None:
        close_lanes(self)
        super().close()


# a connect's errors that mean no Redis is there: nothing listens, no route, no such host
NOTHING_THERE = frozenset(
    {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENOENT, errno.EADDRNOTAVAIL}
)


class _Typed:
    """Mixed into a pool's connection class: a connect that finds no Redis raises
    :class:`RedisUnavailable` (host and port, the socket's error, the fix) instead of
    redis-py's bare ``ConnectionError``. Only connecting pays for it, not a command."""

    def connect(self) -> None:
        try:
            super().connect()  # type: ignore[misc]
        except (redis.AuthenticationError, RedisUnavailable):
            raise
        except redis.ConnectionError as exc:
            cause = exc.__cause__
            nothing_there = isinstance(cause, socket.gaierror) or (
                isinstance(cause, OSError) and cause.errno in NOTHING_THERE
            )
            if not nothing_there:
                raise  # a reset, a TLS handshake, a protocol error: redis-py's own words
            conn: Any = self
            where = getattr(conn, "path", "") or f"{conn.host}:{conn.port}"
            reason = str(cause).strip() or type(cause).__name__
            raise RedisUnavailable(where, reason) from None  # the reason says it all


_TYPED: dict[type, type] = {}


def _typed(pool: redis.ConnectionPool) -> redis.ConnectionPool:
    """``pool``, its connections (and its Lanes', made from the same class) typed."""
    cls = pool.connection_class
    typed = _TYPED.get(cls)
    if typed is None:
        typed = _TYPED[cls] = type(cls.__name__, (_Typed, cls), {})
    pool.connection_class = typed
    return pool


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool (connections follow the master), blocking when all of its
    ``max_connections`` are in use, as :class:`redis.BlockingConnectionPool`."""


def connect(
    url: str,
    *,
    sentinel_master: str | None = None,
    timeout: float | None = None,
    decode_responses: bool = True,
    connections: int | None = None,
) -> redis.Redis:
    """A Redis client (decoded responses unless told otherwise) with keep-alive, a health
    check of idle connections and redis-py's retries. ``timeout`` (s) bounds connecting and
    every reply (default: connecting only, 5 s). ``sentinel_master``: the master's name, needed
    for a ``sentinel://`` URL (``PIPELINE_REDIS_SENTINEL_MASTER``). A ``redis+cluster://``
    URL gives redis-py's cluster client (it follows MOVED and ASK itself). ``connections``:
    the script-call connections a process opens to a server (:class:`~.scripts.Lanes`,
    default ``DEFAULT_LANES``)."""
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
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=CLIENT_POOL, timeout=POOL_WAIT_S, **options
        )
        _typed(pool)
        return _with_lanes(Client.from_pool(pool), connections)
    target = parse_sentinel_url(url)
    if not sentinel_master:
        raise ConfigError(f"a sentinel:// URL needs the master's name: set {MASTER_VAR}")
    sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinels = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)
    client = sentinels.master_for(
        sentinel_master,
        redis_class=Client,
        connection_pool_class=BlockingSentinelPool,
        max_connections=CLIENT_POOL,
        timeout=POOL_WAIT_S,
        db=target.db,
        username=target.username,
        password=target.password,
        **options,
    )
    return _with_lanes(client, connections)


def _with_lanes(client: redis.Redis, connections: int | None) -> redis.Redis:
    if connections is not None:
        set_lanes(client, connections)
    return client
