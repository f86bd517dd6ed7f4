"""Release bell: wakes attempts parked for a gate slot the moment a slot may have freed (a
release in this process, or one published on ``Keys.freed_channel()``), and tells parked
attempts of a cancel. How and why: docs/internals.md."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import redis

from ..store.epoch import LOST_NOTICE
from ..store.keys import sharded

log = logging.getLogger("pipeline.bell")

RECONNECT_S = (0.1, 2.0)  # the listener's back-off after a lost connection
ECHO_S = 0.25  # a direct ring's own Pub/Sub message arrives within this, or is not waited for
MAX_NAMES = 4096  # generations kept (queues and quota keys read lately)
MAX_CANCELLED = 4096  # ids of running requests cancelled lately, kept for their parked attempts
CANCEL_NOTICE = "!cancel"  # first line of a cancel notice on the freed channel
ABORT_NOTICE = "!abort"  # first line of an abort notice: cancelled with running="abort"


class Ticket:
    """One parked wait: rung (ask again), ``granted`` a slot handed over (the giver sets
    ``held`` and ``transferred`` once recorded), ``cancelled``, or timed out."""

    __slots__ = (
        "ctx", "gate", "rid", "bell", "_wake", "done", "rang", "granted", "cancelled", "held",
        "transferred", "sure",
    )  # fmt: skip

    def __init__(
        self, ctx: Any = None, gate: Any = None, rid: str | None = None, bell: str = ""
    ) -> None:
        self.ctx = ctx  # what a giver transfers a slot to; None: no hand-over
        self.gate = gate  # only a holder of this gate hands it a slot
        self.rid = rid  # its request (a cancel notice wakes it)
        self.bell = bell  # where it parked (what a giver transfers depends on it)
        self._wake = threading.Lock()
        self._wake.acquire()
        self.done = False  # woken, granted or timed out (under the bell's lock)
        self.rang = False
        self.granted = False
        self.cancelled = False
        self.held = False
        self.transferred = threading.Event()
        self.sure = False  # granted by a giver whose lease was surely alive (no wait for it)

    def fire(self) -> None:
        self.done = True
        self._wake.release()

    def sleep(self, timeout: float) -> None:
        self._wake.acquire(timeout=max(0.0, timeout))


class ReleaseBell:
    """Per-process generations, one per bell name, and the lines of parked waiters; a ring
    wakes the longest waiting one, not a herd."""

    def __init__(
        self, client: redis.Redis, channels: list[str], abort_channels: list[str] | None = None
    ) -> None:
        self.client = client
        self.channels = channels  # one per pool on a Redis Cluster
        self.abort_channels = abort_channels or []  # Keys.abort_channel(), one per pool
        self._lock = threading.Lock()
        self._waiters: dict[str, deque[Ticket]] = defaultdict(deque)
        self._gen: OrderedDict[str, int] = OrderedDict()
        self._echoes: dict[str, deque[float]] = defaultdict(deque)  # direct rings, by queue
        self._listeners: list[threading.Thread] = []  # one per channel
        self._abort_listeners: list[threading.Thread] = []  # one per abort channel
        self._stopping = threading.Event()
        self._subscribed = threading.Event()
        self._pubsub: redis.client.PubSub | None = None  # the first channel's
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # see cancel_notice
        # what an abort notice calls with its ids (the runtime closes their calls' connections)
        self.on_abort: Callable[[list[str]], None] | None = None
        # what a LOST_NOTICE calls (Redis lost its state: the runtime checks its leases now)
        self.on_lost: Callable[[], None] | None = None
        self.outages = 0  # subscriptions lost so far (Redis restarted, unreachable, ...)
        self.closed = False  # the node is shutting down: nobody parks any more

    def generation(self, queue: str) -> int:
        with self._lock:
            gen = self._gen.get(queue)
            if gen is None:
                gen = self._gen[queue] = 0
                if len(self._gen) > MAX_NAMES:  # forget the least recently read nobody waits on
                    for name in list(self._gen)[: len(self._gen) - MAX_NAMES]:
                        if not self._waiters.get(name):
                            del self._gen[name]
            else:
                self._gen.move_to_end(queue)
            return gen

    def _pop_waiter(self, queue: str, ticket: Ticket | None = None) -> Ticket | None:
        """Take ``ticket`` (None: the longest waiting one) out of ``queue``'s line."""
        waiters = self._waiters.get(queue)
        if not waiters:
            return None
        if ticket is None:
            ticket = waiters.popleft()
        else:
            waiters.remove(ticket)
        if not waiters:
            del self._waiters[queue]
        return ticket

    def waiting(self, queue: str) -> int:
        with self._lock:
            return len(self._waiters.get(queue, ()))

    def expect_echo(self, queue: str) -> None:
        """This process is about to publish a release of ``queue`` and ring it: swallow the
        echo even if it arrives first."""
        with self._lock:
            if self._listeners:
                self._echoes[queue].append(time.monotonic())

    def ring(self, queue: str, *, echo: bool = False) -> None:
        """A slot of ``queue`` may have freed: wake one waiter. ``echo``: the release will be
        published too, so swallow its message instead of waking a second waiter."""
        with self._lock:
            if queue in self._gen:
                self._gen[queue] += 1
            ticket = self._pop_waiter(queue)
            if ticket is not None:
                ticket.rang = True
                ticket.fire()
            if echo and self._listeners:
                self._echoes[queue].append(time.monotonic())

    def hand_over(
        self, names: Sequence[str], gate: Any = None, sure: bool = False
    ) -> Ticket | None:
        """Grant the longest waiter of the first of ``names`` whose longest waiter waits for a
        slot of ``gate`` (None: nobody does); the caller records the transfer (on
        ``ticket.bell``, where it parked) and publishes no release. ``sure``: the giver's
        lease is surely alive (the taker need not wait for the transfer record)."""
        with self._lock:
            if self.closed:
                return None
            for name in names:
                waiters = self._waiters.get(name)
                if waiters and waiters[0].ctx is not None and waiters[0].gate is gate:
                    ticket = self._pop_waiter(name)
                    assert ticket is not None
                    ticket.granted, ticket.sure = True, sure
                    ticket.fire()
                    return ticket
            return None

    def cancel_notice(self, ids: list[str]) -> None:
        """Remember cancelled requests' ids and wake their waiters (``ticket.cancelled``)."""
        with self._lock:
            for rid in ids:
                self._cancelled[rid] = None
                self._cancelled.move_to_end(rid)
            while len(self._cancelled) > MAX_CANCELLED:
                self._cancelled.popitem(last=False)
            wanted = set(ids)
            for queue, waiters in list(self._waiters.items()):
                for ticket in [t for t in waiters if t.rid in wanted]:
                    self._pop_waiter(queue, ticket)
                    ticket.cancelled = True
                    ticket.fire()

    def cancelled(self, rid: str) -> bool:
        """A cancel notice named ``rid`` lately (the attempt then asks Redis)."""
        with self._lock:
            return rid in self._cancelled

    def _is_echo(self, queue: str) -> bool:
        with self._lock:
            pending = self._echoes.get(queue)
            now = time.monotonic()
            while pending and now - pending[0] > ECHO_S:
                pending.popleft()
            if not pending:
                return False
            pending.popleft()
            return True

    def park(
        self,
        queue: str,
        generation: int,
        timeout: float,
        ctx: Any = None,
        gate: Any = None,
        rid: str | None = None,
    ) -> Ticket | None:
        """Block until ``queue`` rang after ``generation``, or ``timeout``; the ticket offered a
        hand-over with ``ctx`` (of ``gate``) and a cancel notice of ``rid``. None: ``queue`` rang
        already (or the bell closed), it returned at once."""
        if self.closed:
            return None
        self._listen()
        with self._lock:
            if self._gen.get(queue, 0) != generation or self.closed:
                return None
            ticket = Ticket(ctx, gate, rid, queue)
            self._waiters[queue].append(ticket)
        ticket.sleep(timeout)
        with self._lock:
            if not ticket.done:  # timed out, still in line
                ticket.done = True
                self._pop_waiter(queue, ticket)
        return ticket

    def close(self) -> None:
        """Wake every waiter for good (a warm shutdown: they go back to their queue)."""
        self.closed = True
        self._wake_all()

    def _wake_all(self) -> None:
        with self._lock:
            for queue in list(self._gen):
                self._gen[queue] += 1
            for waiters in self._waiters.values():
                while waiters:
                    ticket = waiters.popleft()
                    ticket.rang = True
                    ticket.fire()
            self._waiters.clear()

    def stop(self) -> None:
        self._stopping.set()

    def listener_address(self) -> str | None:
        """``host:port`` of the listener's connection (CLIENT LIST's ``addr``), or None."""
        conn = self._pubsub.connection if self._pubsub is not None else None
        sock = getattr(conn, "_sock", None)
        if sock is None:
            return None
        host, port = sock.getsockname()[:2]
        return f"{host}:{port}"

    def listen_for_aborts(self) -> None:
        """Subscribe to the abort channels unless already (an attempt runs in this process).
        They carry nothing else, so a node that never parks spends nothing on releases."""
        if not _alive(self._abort_listeners):
            with self._lock:
                if not _alive(self._abort_listeners):
                    self._abort_listeners = self._start(self.abort_channels, threading.Event())

    def _listen(self) -> None:
        if _alive(self._listeners):
            return
        with self._lock:
            if _alive(self._listeners):
                return
            self._listeners = self._start(self.channels, self._subscribed)
        # the first waiter waits for the subscription: a release before it would be missed
        self._subscribed.wait(1.0)

    def _start(self, channels: list[str], subscribed: threading.Event) -> list[threading.Thread]:
        threads = [
            threading.Thread(
                target=self._run,
                args=(channel, subscribed),
                name="pipeline-release-bell",
                daemon=True,
            )
            for channel in channels
        ]
        for t in threads:
            t.start()
        return threads

    def _heard(self, text: str) -> None:
        """One message: a release (the queue, then quota keys it released), or a notice."""
        names = text.split("\n")
        if names[0] == LOST_NOTICE:
            if self.on_lost is not None:
                self.on_lost()
            return
        if names[0] in (CANCEL_NOTICE, ABORT_NOTICE):
            self.cancel_notice(names[1:])
            if names[0] == ABORT_NOTICE and self.on_abort is not None:
                self.on_abort(names[1:])
            return
        for name in names:
            if not self._is_echo(name):
                self.ring(name)

    def _run(self, channel: str, subscribed: threading.Event) -> None:
        """Listen on one channel; a sharded one (on a Redis Cluster, its pool's slot) with its
        own connection to that slot's primary, so one shard's silence delays no other."""
        delay = RECONNECT_S[0]
        shard = sharded(channel)
        kind = "smessage" if shard else "message"
        while not self._stopping.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            if channel == self.channels[0]:
                self._pubsub = pubsub
            try:
                if shard:
                    pubsub.ssubscribe(channel)
                else:
                    pubsub.subscribe(channel)
                subscribed.set()
                delay = RECONNECT_S[0]
                while not self._stopping.is_set():
                    if shard:
                        message = pubsub.get_sharded_message(timeout=1.0)
                    else:
                        message = pubsub.get_message(timeout=1.0)
                    if message is None or message.get("type") != kind:
                        continue
                    data = message.get("data")
                    self._heard(data.decode() if isinstance(data, bytes) else str(data))
            except Exception as exc:  # noqa: BLE001 - keep listening; waits are bounded
                log.warning("release bell lost its subscription (%s); reconnecting", exc)
                self.outages += 1
                # what was published while away is lost: every waiter re-asks
                self._wake_all()
                self._stopping.wait(delay)
                delay = min(RECONNECT_S[1], delay * 2)
            finally:
                try:  # noqa: SIM105 - as the loop's other handlers
                    pubsub.close()
                except Exception:  # noqa: BLE001 - the connection is gone anyway
                    pass


def _alive(threads: list[threading.Thread]) -> bool:
    return bool(threads) and all(t.is_alive() for t in threads)
