"""Every patch of another library's internals, in one place: three, all to kombu's Redis
transport (celery 5.7.x and kombu 5.7.x, pinned in pyproject.toml;
tests/integration/test_compat.py and, for the no-ack acks, tests/integration/test_wire.py check
each on the pinned versions). Installed by a worker node as it starts (``tasks/node.py``, at
``worker_init``), never on import; :func:`install` first checks kombu against the pinned range.
What each gained on ``bench/overhead.py`` when it went in is in BENCHMARKS.md ("What each
mechanism measured when it went in").

==============  ======================================  ========================  ================
patch           replaces (in ``kombu.transport``)       why                       upstream
==============  ======================================  ========================  ================
closed channel  ``redis.Channel._create_client``        correctness               celery/kombu#582
no-ack acks     ``virtual.Channel.basic_consume``       a round trip per message  none found
BRPOP batch     ``redis.Channel._brpop_start``,         a round trip per message  none (no batch
                ``._brpop_read``, ``._poll_error``                                consume)
==============  ======================================  ========================  ================

- closed channel: a worker that acks (``PIPELINE_BROKER_ACKS=1``) stopped with "Unrecoverable
  error: AttributeError" when Redis restarted (tests/chaos/test_redis_restart.py): once Celery
  has dropped the lost connection, closing its channel (which restores the unacked messages)
  and acking a message delivered on it build a client from ``connection.client``, None by
  then. They now fail with the connection error Celery handles (the messages stay unacked,
  redelivered after the visibility timeout and fenced off by their attempt token). Still so
  on celery 5.7.0 / kombu 5.7.0.
- no-ack acks: kombu's virtual transports still delete the unacked record of a message
  consumed ``no_ack`` when it is acked (a Redis round trip per message, for nothing; the
  pipeline consumes its queues no-ack: see tasks/node.py). Related: celery/celery#1776.
- BRPOP batch: kombu's Redis transport takes one message per BRPOP, one trip through the
  consumer's event loop each; an ``RPOP <n>`` sent behind it takes what the node has room for.

Not patches, but private names the code relies on (check them on an upgrade):
``Celery._get_backend`` (overridden in tasks/app.py), ``RedisBackend._store_result``,
``._get_result_meta`` and ``._MAX_STR_VALUE_SIZE`` (tasks/backend.py), and redis-py's
``Connection.pack_commands`` / ``send_packed_command`` / ``read_response``
(pipeline/store/scripts.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from importlib import metadata
from queue import Empty
from typing import Any

import kombu
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger("pipeline.node")

_create_client = kombu_redis.Channel._create_client


def _guarded_create_client(self: Any, asynchronous: bool = False) -> Any:
    """kombu's client for a channel, or the connection error a channel whose connection Celery
    already dropped (a lost broker) means. kombu built one from ``connection.client``, None by
    then, and its AttributeError escaped Celery's handlers for connection errors."""
    if getattr(self.connection, "client", None) is None:
        raise RedisConnectionError("the broker connection of this channel is closed")
    return _create_client(self, asynchronous=asynchronous)


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

    def tagged(message: Any) -> Any:
        message.delivery_info["consumer_tag"] = consumer_tag
        return callback(message)

    return _basic_consume(self, queue, no_ack, tagged, consumer_tag, **kwargs)


# More messages a BRPOP of a no-ack queue takes in its round trip (RPOP with a count, sent right
# behind it): a dispatch tick pushes ~2 messages at once, and each BRPOP is a round trip through
# the consumer's event loop. Blocked BRPOPs of other nodes are served first (Redis serves every
# client blocked on the list before it reads the rest of this one's pipeline), so the batch
# only takes what no other node was waiting for.
BRPOP_BATCH = 8

# How many more messages the node may take now (its free execution slots, the bound Celery's
# ``worker_disable_prefetch`` keeps: see tasks/node.py), and the queues it consumes no-ack
# (nothing to account per message: no unacked set, no prefetch count). None: no batches.
_room: Callable[[], int] | None = None
_queues: Collection[str] = ()


def bound_batches(room: Callable[[], int] | None, queues: Collection[str] = ()) -> None:
    """Let BRPOPs of the no-ack ``queues`` take a batch of at most ``room()`` messages in all
    (None: one message per BRPOP, kombu's own behaviour)."""
    global _room, _queues
    _room, _queues = room, frozenset(queues)


_brpop_start = kombu_redis.Channel._brpop_start
_brpop_read = kombu_redis.Channel._brpop_read
_poll_error = kombu_redis.Channel._poll_error


def _batched_brpop_start(self: Any, timeout: Any = None) -> None:
    """kombu's BRPOP, followed on the same connection by ``RPOP <queue> <n>`` when the queue
    it takes first is one of the no-ack queues of :func:`bound_batches`."""
    self.__dict__["_pipeline_batch"] = None
    _brpop_start(self, timeout)
    room = _room
    if self._in_poll is None or room is None:
        return
    more = min(BRPOP_BATCH, room() - 1)  # the BRPOP takes one
    if more <= 0:
        return
    queues = self._queue_cycle.consume(len(self.active_queues))  # what the BRPOP took
    if not queues or queues[0] not in _queues:
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


def _batched_poll_error(self: Any, type: str, **options: Any) -> Any:  # noqa: A002 - kombu's
    """kombu reads the BRPOP's reply on a connection error event; a batch's reply behind it
    would be left unread: that connection is dropped (kombu reconnects it)."""
    batch = type == "BRPOP" and self.__dict__.get("_pipeline_batch") is not None
    self.__dict__["_pipeline_batch"] = None
    try:
        return _poll_error(self, type, **options)
    finally:
        if batch:
            self.client.connection.disconnect()


DISTRIBUTION = "celery-llm-pipeline"  # whose requirements (pyproject.toml) pin kombu


class UnsupportedKombu(RuntimeError):
    """The installed kombu is outside the range pyproject.toml pins: the patches here were
    written and checked against that range only."""


def pinned_kombu() -> str | None:
    """The kombu range the installed pipeline requires (pyproject.toml's ``kombu>=…,<…``), or
    None when the pipeline runs uninstalled (no distribution metadata)."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name == "kombu" and req.marker is None:
            return str(req.specifier)
    return None


def check_kombu(version: str | None = None, pinned: str | None = None) -> None:
    """:class:`UnsupportedKombu` unless kombu's ``version`` (default: the installed one) is in
    the ``pinned`` range (default: :func:`pinned_kombu`)."""
    version = version or kombu.__version__
    pinned = pinned if pinned is not None else pinned_kombu()
    if pinned is None:
        log.warning(
            "kombu %s: no pinned range to check it against (the pipeline is not installed); "
            "tasks/compat.py patches it as for the pinned one",
            version,
        )
        return
    if not SpecifierSet(pinned).contains(version, prereleases=True):
        raise UnsupportedKombu(
            f"kombu {version} is installed, but tasks/compat.py patches kombu's Redis transport "
            f"as of the pinned range kombu{pinned} (pyproject.toml): install a kombu in that "
            "range, or check each patch in tasks/compat.py against this kombu (and "
            "tests/integration/test_compat.py) before moving the pin"
        )


_installed = False


def installed() -> bool:
    """Whether :func:`install` ran in this process (a worker node)."""
    return _installed


def install() -> None:
    """Patch kombu, once per process, after :func:`check_kombu`. Only a worker node calls it
    (``tasks/node.py``, at ``worker_init``): a client, ``pipeline serve`` or Flower never
    patches kombu."""
    global _installed
    if _installed:
        return
    check_kombu()
    kombu_redis.Channel._create_client = _guarded_create_client  # type: ignore[method-assign]
    virtual.Channel.basic_consume = _no_ack_basic_consume  # type: ignore[method-assign]
    kombu_redis.Channel._brpop_start = _batched_brpop_start  # type: ignore[method-assign]
    kombu_redis.Channel._brpop_read = _batched_brpop_read  # type: ignore[method-assign]
    kombu_redis.Channel._poll_error = _batched_poll_error  # type: ignore[method-assign]
    _installed = True
