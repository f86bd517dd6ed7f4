"""The Lua scripts (``lua/*.lua``, text from :func:`~.luatext.source`) and how they are called:
``EVALSHA`` over a connection borrowed from the process's few (:class:`Lanes`), one packed
write and one read
(``bench/overhead.py``; docs/internals.md, "Script calls"), else redis-py's own path (it
reconnects and loads the script); ``WAIT`` for replicas in the same write (docs/production.md,
"Waiting for replicas")."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.connection import AbstractConnection
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)

from ..errors import ReplicationError
from .luatext import SCRIPT_NAMES, source

log = logging.getLogger("pipeline.store")

WARN_EVERY_S = 10.0  # a script's "not replicated" warning is logged at most this often


@dataclass(frozen=True)
class Replication:
    """A call returns once ``replicas`` replicas have its writes (``WAIT``) or ``timeout_ms``
    passed; then it raises :class:`~pipeline.errors.ReplicationError` (``strict``) or logs a
    warning (the write stands on the master)."""

    replicas: int
    timeout_ms: int
    strict: bool = False


def replication(name: str, replicas: int, timeout_ms: int) -> Replication | None:
    """How script ``name`` waits for replicas: ``submit`` raises when they do not confirm in
    time; the terminal writes (``finish``, ``cancel``, a dispatch tick) log a warning; the
    rest does not wait (a lost requeue or start comes back when its lease lapses)."""
    if replicas <= 0 or name not in ("submit", "finish", "cancel", "dispatch"):
        return None
    return Replication(replicas, timeout_ms, strict=name == "submit")


DEFAULT_LANES = 24  # script-call connections per process and Redis server (see Lanes)
LANE_WAIT_S = 30.0  # a call waits this long for a free one, then goes redis-py's own way
_lane_sizes: weakref.WeakKeyDictionary[redis.Redis, int] = weakref.WeakKeyDictionary()


def set_lanes(client: redis.Redis, size: int) -> None:
    """How many connections :class:`Lanes` opens for ``client`` (before its first call)."""
    _lane_sizes[client] = max(1, int(size))


def execute_on(conn: AbstractConnection, commands: Sequence[Sequence[Any]]) -> list[Any] | None:
    """Commands sent over ``conn`` in one write: their replies (an error reply as the
    exception, in its place), or None when the connection failed (it is dropped; its next use
    reconnects)."""
    try:
        if not conn.is_connected:
            conn.connect()
        conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:  # read in full: the connection stays in step
                replies.append(exc)
        return replies
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        conn.disconnect()
        return None
    except BaseException:
        conn.disconnect()  # interrupted between send and read: an unread reply may follow
        raise


class Lanes:
    """A process's connections to ``client``'s server for script calls, shared by all its
    threads: a call borrows one for its write and its read and gives it back, so a node opens
    at most ``size`` (``PIPELINE_REDIS_CONNECTIONS``) whatever its slots (``-c``). The one
    given back last is lent first (LIFO: a few stay warm, the rest idle). Made on demand from
    the client's connection settings, outside its redis-py pool (for a Sentinel-managed client
    each asks the sentinels for the current master as it connects). A call that finds all of
    them busy waits for one (at most :data:`LANE_WAIT_S`, then it goes redis-py's way). A
    forked child makes its own. docs/internals.md, "Script calls"."""

    _lock = threading.Lock()
    _of: weakref.WeakKeyDictionary[redis.Redis, Lanes] = weakref.WeakKeyDictionary()

    def __init__(self, client: redis.Redis, size: int = DEFAULT_LANES) -> None:
        self.pool = client.connection_pool
        self.size = size
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self._idle: list[AbstractConnection] = []  # pop / append: atomic under the GIL
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0  # threads waiting for a connection (under _cond)
        self.opened = 0  # connections made, at most size (under _cond)

    @classmethod
    def of(cls, client: redis.Redis) -> Lanes:
        """The one :class:`Lanes` of ``client``."""
        with cls._lock:
            lanes = cls._of.get(client)
            if lanes is None:
                lanes = cls._of[client] = cls(client, _lane_sizes.get(client, DEFAULT_LANES))
            return lanes

    def take(self) -> AbstractConnection:
        """A connection of this process's, the caller's until :meth:`give`; waits for one
        when all are lent (``redis.ConnectionError`` after :data:`LANE_WAIT_S`)."""
        if self.pid != os.getpid():
            with self._lock:
                if self.pid != os.getpid():
                    self._reset()  # the parent's connections are not this process's
        try:
            return self._idle.pop()  # the one given back last
        except IndexError:
            return self._take_slow()

    def _take_slow(self) -> AbstractConnection:
        end = time.monotonic() + LANE_WAIT_S
        with self._cond:
            self._waiting += 1
            try:
                while not self._idle and self.opened >= self.size:
                    left = end - time.monotonic()
                    if left <= 0:
                        raise redis.ConnectionError(
                            f"no Redis connection free in {LANE_WAIT_S:.0f} s"
                        )
                    self._cond.wait(min(left, 1.0))
                if self._idle:
                    return self._idle.pop()
                self.opened += 1
            finally:
                self._waiting -= 1
        try:
            return self.pool.connection_class(**self.pool.connection_kwargs)
        except BaseException:
            with self._cond:
                self.opened -= 1
                self._cond.notify()
            raise

    def give(self, conn: AbstractConnection) -> None:
        if self.pid != os.getpid():
            return  # lent before a fork: the child has its own
        self._idle.append(conn)
        if self._waiting:  # a waiter counted before it looked: it sees this one or is woken
            with self._cond:
                self._cond.notify()

    @contextlib.contextmanager
    def lent(self) -> Iterator[AbstractConnection | None]:
        """A connection borrowed for the block (None: none came free in time)."""
        try:
            conn = self.take()
        except redis.ConnectionError:
            yield None
            return
        try:
            yield conn
        finally:
            self.give(conn)

    def execute(self, commands: Sequence[Sequence[Any]]) -> list[Any] | None:
        """Commands sent in one write over a borrowed connection: as :func:`execute_on`; None
        too when no connection came free in time."""
        try:
            conn = self.take()
        except redis.ConnectionError:
            return None
        try:
            return execute_on(conn, commands)
        finally:
            self.give(conn)

    def close(self) -> None:
        """Disconnect the idle connections (one lent now goes on; a later call reconnects)."""
        for conn in list(self._idle):
            conn.disconnect()


def close_lanes(client: redis.Redis) -> None:
    """Disconnect the script-call connections of ``client`` (its :class:`Lanes`), if any."""
    lanes = Lanes._of.get(client)
    if lanes is not None and lanes.pid == os.getpid():
        lanes.close()


class ThreadConnection:
    """The calling thread's own connection to ``client``'s server, taken from its redis-py
    pool on first use and kept (a forked child takes its own): for a thread that blocks on the
    server (the dispatcher's doorbell wait), so its wait holds none of :class:`Lanes`."""

    _lock = threading.Lock()
    _of: weakref.WeakKeyDictionary[redis.Redis, ThreadConnection] = weakref.WeakKeyDictionary()

    def __init__(self, client: redis.Redis) -> None:
        self.pool = client.connection_pool
        self.local = threading.local()

    @classmethod
    def of(cls, client: redis.Redis) -> ThreadConnection:
        """The one :class:`ThreadConnection` of ``client``."""
        with cls._lock:
            lanes = cls._of.get(client)
            if lanes is None:
                lanes = cls._of[client] = cls(client)
            return lanes

    def get(self) -> AbstractConnection:
        conn: AbstractConnection | None = getattr(self.local, "conn", None)
        if conn is None or self.local.pid != os.getpid():
            conn = self.pool.get_connection()
            self.local.conn, self.local.pid = conn, os.getpid()
        return conn

    def execute(self, commands: Sequence[Sequence[Any]]) -> list[Any] | None:
        """As :func:`execute_on`, over this thread's connection."""
        return execute_on(self.get(), commands)


# a reply that says the key's slot is elsewhere or the script unknown: ask redis-py's path
REROUTE = (NoScriptError, AskError, TryAgainError, ClusterDownError)


def node_client(client: redis.Redis, key: str) -> redis.Redis:
    """The client of the server holding ``key``: ``client`` itself, or on a Redis Cluster the
    primary of the key's slot (as redis-py last mapped it; a MOVED reply remaps it)."""
    if not isinstance(client, RedisCluster):
        return client
    node = client.get_node_from_key(key)
    if node.redis_connection is None:  # not connected yet: redis-py connects it
        client.nodes_manager.initialize()
        node = client.get_node_from_key(key)
    return node.redis_connection


class Script:
    """A Lua script registered on ``client``, called as ``script(keys=[...], args=[...])``.
    On a Redis Cluster every key of a call is in one slot, and the call goes to its primary."""

    def __init__(
        self,
        client: redis.Redis,
        text: str,
        *,
        name: str = "script",
        replication: Replication | None = None,
    ) -> None:
        self.client = client
        self.name = name
        self.replication = replication
        self._script = client.register_script(text)
        self.sha: str = self._script.sha
        self.cluster = isinstance(client, RedisCluster)
        self._lanes = None if self.cluster else Lanes.of(client)
        self._warned = 0.0

    def command(self, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def __call__(
        self,
        keys: Sequence[Any] = (),
        args: Sequence[Any] = (),
        *,
        wait_if: Callable[[Any], bool] | None = None,
    ) -> Any:
        """The script's reply. ``wait_if`` (a script that waits for replicas): the ``WAIT``
        follows, on the same connection, only when it says the reply wrote what must survive
        a failover (a dispatch tick that resulted requests); else it goes in the same write."""
        rep = self.replication
        command = self.command(keys, args)
        wait = ("WAIT", rep.replicas, rep.timeout_ms) if rep else None
        later = wait is not None and wait_if is not None
        lanes = self._lanes or Lanes.of(node_client(self.client, str(keys[0])))
        if later:  # the WAIT, if any, on the connection that wrote: it waits for its writes
            with lanes.lent() as conn:
                replies = None if conn is None else execute_on(conn, [command])
                if (
                    conn is not None
                    and wait is not None
                    and replies is not None
                    and not isinstance(replies[0], Exception)
                    and wait_if is not None
                    and wait_if(replies[0])
                ):
                    acked = execute_on(conn, [wait])
                    replies.append(0 if acked is None else acked[0])  # a lost WAIT: none
        else:
            replies = lanes.execute([command, wait] if wait else [command])
        if replies is None or isinstance(replies[0], REROUTE):
            replies = self._slow(keys, args, wait)  # with its WAIT, as it may have written
        reply = replies[0]
        if isinstance(reply, Exception):
            raise reply  # the script's own error
        if rep is not None and len(replies) > 1:
            if isinstance(replies[1], Exception):
                raise replies[1]
            self._check(rep, int(replies[1]))
        return reply

    def _slow(self, keys: Sequence[Any], args: Sequence[Any], wait: Any) -> list[Any]:
        """redis-py's path: it reconnects with the client's retries and loads the script."""
        if wait is None:
            return [self._script(keys=keys, args=args)]
        if isinstance(self.client, RedisCluster):  # WAIT where the script wrote: its primary
            self.client.script_load(self._script.script)  # on every primary
            self.client.nodes_manager.initialize()  # the slot map again (MOVED, a failover)
            client = node_client(self.client, str(keys[0]))
            replies = Lanes.of(client).execute([self.command(keys, args), wait])
            if replies is None or isinstance(replies[0], REROUTE):
                raise redis.ConnectionError(f"{self.name}: the key's slot is moving; retry")
            return replies
        with self.client.pipeline(transaction=False) as pipe:
            self._script(keys=keys, args=args, client=pipe)
            pipe.execute_command(*wait)
            return list(pipe.execute(raise_on_error=False))

    def _check(self, rep: Replication, acked: int) -> None:
        if acked >= rep.replicas:
            return
        error = ReplicationError(self.name, rep.replicas, acked, rep.timeout_ms)
        if rep.strict:
            raise error
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning(
                "%s: written on the Redis master, but %d of %d replica(s) confirmed it "
                "within %d ms (PIPELINE_REDIS_MIN_REPLICAS); a failover now could lose it",
                self.name,
                acked,
                rep.replicas,
                rep.timeout_ms,
            )


def register(client: redis.Redis, name: str, library: bool = False) -> Script:
    """A stand-alone script (``lua/<name>.lua``, a gate's) registered on ``client``; with
    ``library``, with the definitions of lib.lua it uses (it reads no key families)."""
    return Script(client, source(name, library=library), name=name)


@dataclass(frozen=True)
class ScriptCall:
    """One script call, to be sent with others in one round trip (:func:`run_batch`)."""

    script: Script
    keys: list[str]
    args: list[Any]

    def __call__(self) -> Any:
        return self.script(keys=self.keys, args=self.args)


def run_batch(client: redis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Script calls in one round trip, run in order (each atomic, not all together): their
    replies, or in a failed call's place the error it raised. A call that did not run in the
    batch (the connection failed, or the server lost its script) is run again on its own,
    which reconnects and loads the script. A call that waits for replicas runs after the
    others, with its WAIT."""
    batched = [c for c in calls if c.script.replication is None]
    lane = Lanes.of(node_client(client, calls[0].keys[0]) if calls else client)
    replies = lane.execute([c.script.command(c.keys, c.args) for c in batched])
    got = iter(replies if replies is not None else [NoScriptError()] * len(batched))
    out: list[Any] = []
    for call in calls:
        reply = next(got) if call.script.replication is None else NoScriptError()
        if isinstance(reply, REROUTE):
            try:
                reply = call()
            except redis.RedisError as exc:
                reply = exc
        out.append(reply)
    return out


class Scripts:
    """The request-state scripts registered on one Redis client, as attributes
    (``scripts.finish(keys=..., args=...)``); with ``replicas``, those whose writes must
    survive a failover wait for that many replicas (:func:`replication`)."""

    def __init__(self, client: redis.Redis, replicas: int = 0, timeout_ms: int = 1000) -> None:
        self._scripts = {
            n: Script(client, source(n), name=n, replication=replication(n, replicas, timeout_ms))
            for n in SCRIPT_NAMES
        }

    def __getattr__(self, name: str) -> Script:
        try:
            return self._scripts[name]
        except KeyError:
            raise AttributeError(name) from None
