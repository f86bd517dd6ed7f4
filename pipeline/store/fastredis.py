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

The connections are built like the pool's own (``connection_class(**connection_kwargs)``): for
a Sentinel-managed client that is a ``SentinelManagedConnection`` holding the pool's proxy, so
each one asks the sentinels for the current master when it (re)connects, and one still open to
a master that was demoted answers READONLY, drops and takes redis-py's path: after a failover
every thread reconnects to the new master by itself.

:class:`Replication`: a script whose writes must survive a failover is followed by Redis's
``WAIT <replicas> <timeout>`` on the *same* connection (WAIT counts the replicas that have
everything that connection wrote), in the same packed write: no extra round trip.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.connection import AbstractConnection
from redis.exceptions import NoScriptError, ResponseError

from ..errors import ReplicationError

log = logging.getLogger("pipeline.store")

_FALLBACK = (redis.ConnectionError, redis.TimeoutError, OSError)
WARN_EVERY_S = 10.0  # a script's "not replicated" warning is logged at most this often


@dataclass(frozen=True)
class Replication:
    """A script call returns only once ``replicas`` replicas have its writes (Redis ``WAIT``),
    or ``timeout_ms`` passed: then it raises :class:`~pipeline.errors.ReplicationError`
    (``strict``) or logs a warning (the write stands on the master). ``when``: WAIT only if the
    reply says the call wrote something that must be kept (then as a second command on the
    same connection); None: after every call, in the same write."""

    replicas: int
    timeout_ms: int
    strict: bool = False
    when: Callable[[Any], bool] | None = None


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

    def execute(self, commands: Sequence[Sequence[Any]]) -> list[Any] | None:
        """Commands sent in one write over this thread's connection: their replies (an error
        reply as the exception, in its place), or None when the connection failed."""
        conn = self.get()
        try:
            if not conn.is_connected:
                # the connection's own connect(): a SentinelManagedConnection asks the sentinels
                # for the master there (send_packed_command would connect to its default
                # host, localhost:6379, instead)
                conn.connect()
            conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
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


class Library:
    """A Redis Functions library on one client's server (pipeline/store/functions.py): loaded
    when a call finds it missing; given up for the life of the client when the server has no
    Functions (Redis before 7) or refuses the user them (an ACL without FCALL or FUNCTION):
    its scripts are then called with EVALSHA. A load the server cannot do now (out of memory,
    a read-only replica) fails that call, as a script's write would, and the next call tries
    again."""

    def __init__(self, client: redis.Redis, name: str, code: str) -> None:
        self.client = client
        self.name = name
        self.code = code
        self.usable = True
        self.loads = 0  # how often this process loaded it
        self._lock = threading.Lock()

    def recover(self, reply: ResponseError, seen: int) -> bool:
        """After a call of one of its functions answered ``reply``: load the library (it was
        missing) or give it up (the server has no FCALL). ``seen``: :attr:`loads` when that
        call was sent; a load since (another thread's) is not repeated. True when calling again
        may now succeed."""
        text = str(reply)
        if _no_fcall(text):
            self._give_up(text)
            return True
        if not _function_missing(text):
            return False
        with self._lock:
            if self.loads != seen:
                return True  # another thread loaded it while this call was on its way
            try:
                self.client.function_load(self.code, replace=True)
                self.loads += 1
            except ResponseError as exc:
                if not _refused(str(exc)):
                    raise  # a full or read-only server: this call fails, the next one loads it
                self._give_up(str(exc))
            except _FALLBACK:
                return False
        return True

    def _give_up(self, why: str) -> None:
        """Call the scripts with EVALSHA from now on; logged once, as a warning when the user
        was refused (an ACL to fix), else (a server without Functions) for information."""
        if self.usable:
            self.usable = False
            refused = not why.lower().startswith("unknown command")
            log.log(
                logging.WARNING if refused else logging.INFO,
                "Redis Functions library %s not used (%s): the scripts run with EVALSHA",
                self.name,
                why.split(",")[0],
            )


def _function_missing(text: str) -> bool:
    """The server does not have the function called (it lost or never had the library)."""
    return text.startswith("Function not found")


def _refused(text: str) -> bool:
    """The server will not load a library for this user: it has no Functions, or the user's
    ACL does not allow ``FUNCTION LOAD``."""
    return text.lower().startswith("unknown command") or "permissions to run the 'function" in text


def _no_fcall(text: str) -> bool:
    """The server will not run FCALL: it has no such command (before Redis 7), or the user's
    ACL does not allow it."""
    head = text[:24].lower()  # "unknown command 'FCALL'" (7.x), "... `FCALL`" (6.2)
    return (head.startswith("unknown command") and "fcall" in head) or (
        "permissions to run the 'fcall'" in text
    )


def needs_recovery(reply: Any) -> bool:
    """Whether a script call's reply says the script did not run because the server lacks it
    (NOSCRIPT, a missing function, no FCALL): calling again through the script loads it, or
    calls it with EVALSHA."""
    if isinstance(reply, NoScriptError):
        return True
    if not isinstance(reply, ResponseError):
        return False
    text = str(reply)
    return _function_missing(text) or _no_fcall(text)


_libraries: weakref.WeakKeyDictionary[redis.Redis, dict[str, Library]] = weakref.WeakKeyDictionary()


def library_on(client: redis.Redis, name: str, code: str) -> Library:
    """The one :class:`Library` ``name`` of ``client`` (shared by the scripts it holds)."""
    with _lanes_lock:
        libs = _libraries.setdefault(client, {})
        lib = libs.get(name)
        if lib is None:
            lib = libs[name] = Library(client, name, code)
        return lib


class FastScript:
    """A Lua script registered on ``client``, called like redis-py's ``Script``
    (``script(keys=[...], args=[...])``) over the calling thread's own connection, followed by
    a WAIT for replicas when it has a :class:`Replication` (``name`` names it in errors).
    With ``function`` (its name in ``library``) it is called with FCALL while the library is
    usable, else with EVALSHA of ``text`` (the same code)."""

    def __init__(
        self,
        client: redis.Redis,
        text: str,
        *,
        name: str = "script",
        replication: Replication | None = None,
        function: str | None = None,
        library: Library | None = None,
    ) -> None:
        self.client = client
        self.script = client.register_script(text)  # the fallback: loads, retries
        self.sha: str = self.script.sha
        self.lanes = thread_connections(client)
        self.name = name
        self.replication = replication
        self.function = function if library is not None else None
        self.library = library
        self._warned = 0.0

    def command(self, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
        """The call as one Redis command: FCALL of its function, or EVALSHA."""
        if self.function is not None and self.library is not None and self.library.usable:
            return ("FCALL", self.function, len(keys), *keys, *args)
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def __call__(
        self,
        keys: Sequence[Any] = (),
        args: Sequence[Any] = (),
        client: Any = None,
        *,
        retried: bool = False,
    ) -> Any:
        if client is not None:  # queued on a redis-py pipeline (or another client), as Script
            return self.script(keys=keys, args=args, client=client)
        rep = self.replication
        command = self.command(keys, args)
        loads = self.library.loads if self.library is not None else 0
        inline = rep is not None and rep.when is None
        replies = self.lanes.execute(
            [command, ("WAIT", rep.replicas, rep.timeout_ms)] if inline and rep else [command]
        )
        if replies is not None:
            reply = replies[0]
            if not isinstance(reply, ResponseError):
                if rep is not None:
                    self._replicated(rep, reply, replies[1] if inline else None)
                return reply
            lib = self.library
            if not retried and command[0] == "FCALL" and lib and lib.recover(reply, loads):
                return self(keys, args, retried=True)  # the library loaded, or EVALSHA now
            if not isinstance(reply, NoScriptError):
                raise reply  # the script's own error
        if rep is None:
            return self.script(keys=keys, args=args)  # redis-py loads the script, or reconnects
        # redis-py's path, the script and its WAIT on one connection (a pipeline loads the
        # script first and retries the pair on a broken connection)
        with self.client.pipeline(transaction=False) as pipe:
            self.script(keys=keys, args=args, client=pipe)
            pipe.wait(rep.replicas, rep.timeout_ms)
            reply, acked = pipe.execute()
        self._check(rep, int(acked))
        return reply

    def _replicated(self, rep: Replication, reply: Any, acked: Any) -> None:
        """Check the WAIT sent with the call (``acked``), or send it now when ``rep.when``
        says the reply wrote something to keep: over the same thread connection, which made
        the write (WAIT waits for everything the connection wrote)."""
        if acked is None:
            try:
                needed = rep.when is None or rep.when(reply)
            except Exception:  # noqa: BLE001 - an unexpected reply: wait, to be safe
                needed = True
            if not needed:
                return
            replies = self.lanes.execute([("WAIT", rep.replicas, rep.timeout_ms)])
            acked = replies[0] if replies is not None else 0
        if isinstance(acked, ResponseError):
            raise acked
        self._check(rep, int(acked))

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


def call_batch(
    client: redis.Redis, calls: Sequence[tuple[FastScript, Sequence[Any], Sequence[Any]]]
) -> list[Any] | None:
    """``(script, keys, args)`` calls in one write over the calling thread's own connection,
    each sent as :meth:`FastScript.command` builds it, run in order (each atomic): their replies
    (an error in its call's place), or None when the connection failed."""
    return thread_connections(client).execute([s.command(k, a) for s, k, a in calls])
