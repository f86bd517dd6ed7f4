"""Patches to kombu's Redis transport (kombu 5.x) — a guard around a race, a client cache — and
to billiard's picklable tracebacks (a lazy copy of code positions, a one-line traceback for the
exceptions that only report an attempt's outcome: :class:`BriefTraceback`).

When the broker connection drops, Celery's consumer releases the connection; closing its
channel then restores the unacknowledged messages, which needs a *new* Redis client built
from ``channel.connection.client`` — already ``None`` by then. The AttributeError escapes
``ignore_errors`` and the worker stops with "Unrecoverable error: AttributeError('NoneType'
object has no attribute 'hostname')" instead of reconnecting (seen here when Redis restarts;
compare celery/kombu#582). We skip that restore when the connection is gone: the messages stay
in kombu's unacked set, are redelivered after the visibility timeout, and are fenced off by
their attempt token, while the pipeline's reaper has already re-dispatched their requests.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable
from queue import Empty
from typing import Any

from billiard import einfo as billiard_einfo
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

log = logging.getLogger("pipeline.compat")
_restore_unacked = kombu_redis.QoS.restore_unacked


def _guarded_restore_unacked(self: Any, client: Any = None) -> Any:
    if client is None and getattr(self.channel.connection, "client", None) is None:
        log.warning(
            "broker connection gone: leaving %d unacked message(s) for the visibility timeout",
            len(self._delivered),
        )
        self._delivered.clear()
        return None
    return _restore_unacked(self, client)


_create_client = kombu_redis.Channel._create_client


def _cached_create_client(self: Any, asynchronous: bool = False) -> Any:
    """One synchronous Redis client per channel instead of a new one per publish.

    kombu builds a ``redis.Redis`` around the channel's pool for every publish and every event;
    with redis-py 8 that constructor costs ~0.5 ms of CPU (it builds its response-callback
    table), about a fifth of an ``apply_async``. Clients are thread-safe views of the pool, so
    one per channel is enough; a new channel (after a reconnect) gets a new one."""
    if asynchronous:
        return _create_client(self, asynchronous=True)
    client = self.__dict__.get("_pipeline_sync_client")
    if client is None:
        client = self.__dict__["_pipeline_sync_client"] = _create_client(self)
    return client


class _NoPositions:
    """A code object's stand-in while billiard copies it: every attribute but the positions."""

    def __init__(self, code: Any) -> None:
        self._code = code

    def __getattr__(self, name: str) -> Any:
        return getattr(self._code, name)

    def co_positions(self) -> Any:
        return iter(())


_code_init = billiard_einfo._Code.__init__


def _lazy_code_init(self: Any, code: Any) -> None:
    """billiard's ``_Code`` without copying ``co_positions`` up front.

    Celery builds an ``ExceptionInfo`` for every ``Retry`` (and failure); on Python 3.11
    billiard's copy of each traceback frame's code lists all its positions — 2,341 tuples for
    Celery's ``trace_task`` alone, ~0.3 ms of GIL per retried attempt, for positions nobody
    reads unless the traceback object is formatted again. Here they are listed when first
    read, or when the object is pickled (a prefork child sending it to its parent)."""
    _code_init(self, _NoPositions(code))
    self.__dict__["_pipeline_code"] = code


def _positions(self: Any) -> Any:
    code = self.__dict__.pop("_pipeline_code", None)
    if code is not None:
        self._co_positions = list(code.co_positions())
    return self._co_positions.__iter__


def _reduce(self: Any) -> Any:
    _positions(self)
    return billiard_einfo._Code.__new__, (billiard_einfo._Code,), self.__dict__


class BriefTraceback:
    """Marks an exception that reports how an attempt ended (a retry, a failed request), raised by
    the task body on purpose: the traceback Celery keeps for it (in the result backend, in
    the ``task-retried`` / ``task-failed`` event Flower shows) is its one-line summary, not
    the frames of Celery's tracer. Formatting those frames cost ~0.6 ms of GIL per retry."""


def brief(exc: BaseException) -> str:
    """The traceback Celery keeps for a :class:`BriefTraceback` exception: its one line."""
    return "".join(traceback.format_exception_only(type(exc), exc))


_einfo_init = billiard_einfo.ExceptionInfo.__init__


def _brief_einfo_init(self: Any, exc_info: Any = None, internal: bool = False) -> None:
    info = exc_info or sys.exc_info()
    exception = info[1]
    if not isinstance(exception, BaseException) or not isinstance(exception, BriefTraceback):
        _einfo_init(self, info, internal)
        return
    self.type = info[0]
    self.tb = billiard_einfo.Traceback(info[2])
    self.traceback = brief(exception)
    self.internal = internal
    self.exception = billiard_einfo.ExceptionWithTraceback(exception, self.traceback)


_basic_consume = virtual.Channel.basic_consume


def _no_ack_basic_consume(
    self: Any, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
) -> Any:
    """kombu's virtual transports skip the unacked bookkeeping of a ``no_ack`` consumer's
    messages on delivery, but still run it on ``ack()`` (a Redis round trip each): they never
    fill ``Channel.no_ack_consumers``, which is what ``Message.ack`` checks. Fill it, and tag
    each delivered message with its consumer, so an ack of a no-ack message is a no-op."""
    if not no_ack:
        return _basic_consume(self, queue, no_ack, callback, consumer_tag, **kwargs)
    if self.no_ack_consumers is None:
        self.no_ack_consumers = set()
    self.no_ack_consumers.add(consumer_tag)
    self.__dict__.setdefault("_pipeline_no_ack_queues", set()).add(queue)

    def tagged(message: Any) -> Any:
        message.delivery_info["consumer_tag"] = consumer_tag
        return callback(message)

    return _basic_consume(self, queue, no_ack, tagged, consumer_tag, **kwargs)


# More messages a no-ack consumer takes in the round trip of its BRPOP (RPOP with a count,
# sent right behind it): a dispatch tick pushes ~2 messages at once, and each BRPOP is a
# Redis round trip (~50 µs of the server's CPU on a cold cache). Blocked BRPOPs of other nodes
# are served first (Redis serves every client blocked on the list before it reads the rest of
# this one's pipeline), so the batch only takes what no other node was waiting for.
BRPOP_BATCH = 8

# How many more messages the node may take now (its free execution slots, the bound Celery's
# ``worker_disable_prefetch`` keeps: see tasks/node.py); None: no batches.
_room: Callable[[], int] | None = None


def bound_batches(room: Callable[[], int] | None) -> None:
    """Let no-ack BRPOPs take a batch of at most ``room()`` messages in all (None: one)."""
    global _room
    _room = room


_brpop_start = kombu_redis.Channel._brpop_start
_brpop_read = kombu_redis.Channel._brpop_read


def _batched_brpop_start(self: Any, timeout: Any = None) -> None:
    """kombu's BRPOP, followed on the same connection by ``RPOP <queue> BRPOP_BATCH`` when
    the queue it takes first is consumed no-ack (nothing to account per message: no unacked
    set, no prefetch limit)."""
    self.__dict__["_pipeline_batch"] = None
    _brpop_start(self, timeout)
    room = _room
    if self._in_poll is None or room is None:
        return
    more = min(BRPOP_BATCH, room() - 1)  # the BRPOP takes one
    if more <= 0:
        return
    queues = self._queue_cycle.consume(len(self.active_queues))  # what the BRPOP took
    if not queues or queues[0] not in self.__dict__.get("_pipeline_no_ack_queues", ()):
        return
    args = ["RPOP", self._q_for_pri(queues[0], 0), more]
    if self.global_keyprefix:
        args = self.client._prefix_args(args)
    self.client.connection.send_command(*args)
    self.__dict__["_pipeline_batch"] = queues[0]


def _batched_brpop_read(self: Any, **options: Any) -> Any:
    """kombu's BRPOP read, then the batch's reply: its messages are delivered after the
    BRPOP's, in the list's order (also when the BRPOP timed out)."""
    queue = self.__dict__.get("_pipeline_batch")
    if queue is None:
        return _brpop_read(self, **options)
    self.__dict__["_pipeline_batch"] = None
    connection = self.client.connection
    try:
        got = _brpop_read(self, **options)
    except Empty:
        got = False
    except Exception:
        connection.disconnect()  # the batch's reply is still unread
        raise
    try:
        items = self.client.parse_response(connection, "RPOP")
    except self.connection_errors:
        connection.disconnect()
        raise
    for item in items or ():
        self.connection._deliver(loads(bytes_to_str(item)), queue)
        got = True
    if not got:
        raise Empty()
    return True


_poll_error = kombu_redis.Channel._poll_error


def _batched_poll_error(self: Any, type: str, **options: Any) -> Any:
    """kombu reads the BRPOP's reply on a connection error event; a batch's reply behind it
    would be left unread: that connection is dropped (kombu reconnects it)."""
    batch = type == "BRPOP" and self.__dict__.get("_pipeline_batch") is not None
    self.__dict__["_pipeline_batch"] = None
    try:
        return _poll_error(self, type, **options)
    finally:
        if batch:
            self.client.connection.disconnect()


def install() -> None:
    virtual.Channel.basic_consume = _no_ack_basic_consume  # type: ignore[method-assign]
    if hasattr(billiard_einfo._Code, "co_positions"):  # Python >= 3.11
        billiard_einfo._Code.__init__ = _lazy_code_init
        billiard_einfo._Code.co_positions = property(_positions)
        billiard_einfo._Code.__reduce__ = _reduce
    billiard_einfo.ExceptionInfo.__init__ = _brief_einfo_init
    kombu_redis.QoS.restore_unacked = _guarded_restore_unacked  # type: ignore[method-assign]
    kombu_redis.Channel._create_client = _cached_create_client  # type: ignore[method-assign]
    kombu_redis.Channel._brpop_start = _batched_brpop_start  # type: ignore[method-assign]
    kombu_redis.Channel._brpop_read = _batched_brpop_read  # type: ignore[method-assign]
    kombu_redis.Channel._poll_error = _batched_poll_error  # type: ignore[method-assign]
