"""Lua script calls over one dedicated Redis connection per thread.

redis-py's ``Redis.execute_command`` borrows a pooled connection for every command: the pool
locks, checks the process id and polls the socket for stray data (a syscall) on each borrow,
and the command goes through retry and observability wrappers. For the scripts an attempt runs
(start + acquire, finish or requeue, a hand-over's transfer) and a dispatcher's ticks that was
~45 % of the CPU a call costs (~150 µs of which ~95 µs is the round trip itself), in a worker
whose consumer, dispatcher and attempt threads share one GIL. Here each thread keeps its own
connection to the client's server (same address, credentials, TLS and decoding) and a call is
one packed send and one read.

A call falls back to redis-py's own path, which loads a missing script (NOSCRIPT) and
reconnects with the client's retries, whenever the fast path cannot answer: so the behaviour
on a restarted or unreachable server is redis-py's. Any other interruption between send and
read drops the connection (it may hold an unread reply).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import redis
from redis.connection import AbstractConnection
from redis.exceptions import NoScriptError, ResponseError

_FALLBACK = (redis.ConnectionError, redis.TimeoutError, OSError)


class ThreadConnections:
    """One connection per thread (and per process: a forked child makes its own) to the server
    of ``client``'s pool, outside the pool."""

    def __init__(self, client: redis.Redis) -> None:
        self.pool = client.connection_pool
        self.local = threading.local()

    def get(self) -> AbstractConnection:
        conn: AbstractConnection | None = getattr(self.local, "conn", None)
        if conn is None or self.local.pid != os.getpid():
            conn = self.pool.connection_class(**self.pool.connection_kwargs)
            self.local.conn, self.local.pid = conn, os.getpid()
        return conn

    def evalsha(
        self, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]]
    ) -> list[Any] | None:
        """``(sha, keys, args)`` calls sent in one write over this thread's connection, run in
        order (each atomic): their replies, an error reply in its call's place as the exception
        (NOSCRIPT included). None when the connection failed: nothing is known of what ran."""
        conn = self.get()
        try:
            conn.send_packed_command(
                conn.pack_commands(
                    [("EVALSHA", sha, len(keys), *keys, *args) for sha, keys, args in calls]
                ),
                check_health=False,
            )
            replies: list[Any] = []
            for _ in calls:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:  # read in full: the connection stays in step
                    replies.append(exc)
            return replies
        except _FALLBACK:
            conn.disconnect()
            return None
        except BaseException:
            conn.disconnect()  # interrupted between send and read: an unread reply may follow
            raise


_lanes: weakref.WeakKeyDictionary[redis.Redis, ThreadConnections] = weakref.WeakKeyDictionary()
_lanes_lock = threading.Lock()


def thread_connections(client: redis.Redis) -> ThreadConnections:
    """The one :class:`ThreadConnections` of ``client`` (shared by all its scripts)."""
    lanes = _lanes.get(client)
    if lanes is None:
        with _lanes_lock:
            lanes = _lanes.get(client)
            if lanes is None:
                lanes = _lanes[client] = ThreadConnections(client)
    return lanes


class FastScript:
    """A Lua script registered on ``client``, called like redis-py's ``Script``
    (``script(keys=[...], args=[...])``) over the calling thread's own connection."""

    def __init__(self, client: redis.Redis, text: str) -> None:
        self.script = client.register_script(text)  # the fallback: loads, retries
        self.sha: str = self.script.sha
        self.lanes = thread_connections(client)

    def __call__(
        self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None
    ) -> Any:
        if client is not None:  # queued on a redis-py pipeline (or another client), as Script
            return self.script(keys=keys, args=args, client=client)
        replies = self.lanes.evalsha([(self.sha, keys, args)])
        if replies is not None:
            reply = replies[0]
            if not isinstance(reply, ResponseError):
                return reply
            if not isinstance(reply, NoScriptError):
                raise reply  # the script's own error
        return self.script(keys=keys, args=args)  # redis-py loads the script, or reconnects


def call_batch(
    client: redis.Redis, calls: Sequence[tuple[Any, Sequence[Any], Sequence[Any]]]
) -> list[Any] | None:
    """``(script, keys, args)`` calls (a script: anything with a ``sha``) in one write over the
    calling thread's own connection: :meth:`ThreadConnections.evalsha`."""
    return thread_connections(client).evalsha([(s.sha, k, a) for s, k, a in calls])
