"""Release bell: wakes attempts parked for a gate slot the moment a slot may have freed.

A parked attempt (a full slot gate, or a blocking gate's Wait) must not sleep-poll: every
millisecond between a release and the next admission is a millisecond the model server idles.
Two sources ring the bell for a queue:

- this process, right after it released a reservation (:meth:`ReleaseBell.ring`), so a waiter
  in the same process wakes with no Redis round trip;
- every other process, through Redis Pub/Sub: the scripts that end an attempt or give it back
  (``finish``, ``requeue``) publish the queue's name on ``Keys.freed_channel()``. One listener
  thread per process, started by the first park, turns those messages into rings.

A release in this process rings twice: directly, and again when its own Pub/Sub message comes
back. The echo is swallowed (each direct ring expects one echo of its queue within
``ECHO_S``), so one release wakes one waiter here, not two that race for one slot.

A holder of a slot gate that hands its slot over (``HandsOver``) does not ring at all:
:meth:`ReleaseBell.hand_over` grants the longest-parked waiter the slot outright (its ticket
says ``granted``), and the giver's finish / requeue publishes nothing (no slot was freed).

A waiter reads the queue's generation *before* it asks the gate and then waits for the
generation to move, so a release between the refusal and the wait is never missed. Waits are
bounded (the caller re-asks its gate on time-out), so a lost message — the listener
reconnecting after a Redis restart, a lease freed by a reaper — costs latency, never liveness.

Besides queues, a bell rings for each per-key quota key (``quota:userid:alice``): the scripts
publish the key with the queue when a request of it leaves the active state (one message,
``<queue>\n<key>...``), and an attempt refused by that key parks on it (``Decision.wake_key``).
There may be any number of keys, so the bell keeps generations only for names someone read
(at most ``MAX_NAMES``, least recently read first out; a waiter whose name was dropped just
asks its gate again) and no empty waiter lines.

A cancel of a running request (``cancel.lua``, ``batch_cancel_lines.lua``) publishes
``!cancel\n<id>...`` on the same channel (no queue name starts with ``!``): the listener
remembers the ids (:meth:`ReleaseBell.cancelled`, the last ``MAX_CANCELLED``) and wakes the
waiters parked for those requests (``ticket.cancelled``), which then end unsent instead of
waiting for a slot. A lost notice is caught by the attempt's own check when its park times
out (``PARK_POLL_S``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict, deque
from typing import Any

import redis

log = logging.getLogger("pipeline.bell")

RECONNECT_S = (0.1, 2.0)  # the listener's back-off after a lost connection
ECHO_S = 0.25  # a direct ring's own Pub/Sub message arrives within this, or is not waited for
MAX_NAMES = 4096  # generations kept (queues and quota keys read lately)
MAX_CANCELLED = 4096  # ids of running requests cancelled lately, kept for their parked attempts
CANCEL_NOTICE = "!cancel"  # first line of a cancel notice on the freed channel


class Ticket:
    """One parked wait: woken by a ring (ask the gate again) or granted a slot handed over by
    a holder of this process (``granted``: go to the server; the giver is recording the
    transfer in Redis and sets ``transferred`` when done, ``held`` telling whether it took)."""

    __slots__ = (
        "ctx", "gate", "rid", "_wake", "done", "rang", "granted", "cancelled", "held",
        "transferred",
    )  # fmt: skip

    def __init__(self, ctx: Any = None, gate: Any = None, rid: str | None = None) -> None:
        self.ctx = ctx  # what a giver needs to transfer a slot to this waiter; None: no hand-over
        self.gate = gate  # the gate the waiter asks: only a holder of that gate hands it a slot
        self.rid = rid  # the request the waiter's attempt is for (a cancel notice wakes it)
        self._wake = threading.Lock()
        self._wake.acquire()
        self.done = False  # woken, granted or timed out (under the bell's lock)
        self.rang = False
        self.granted = False
        self.cancelled = False  # woken by a cancel notice for its request
        self.held = False
        self.transferred = threading.Event()

    def fire(self) -> None:
        """Wake the waiter (under the bell's lock)."""
        self.done = True
        self._wake.release()

    def sleep(self, timeout: float) -> None:
        """Block until fired, at most ``timeout`` s."""
        self._wake.acquire(timeout=max(0.0, timeout))


class ReleaseBell:
    """Per-process generation counters, one per queue, and the tickets of parked waiters.

    A ring wakes *one* waiter of the queue (the longest waiting: parked attempts are admitted
    in the order they parked, which is the dispatch order), not a herd that would all ask the
    gate for one slot. :meth:`hand_over` grants the longest waiting a slot outright."""

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self.client = client
        self.channel = channel
        self._lock = threading.Lock()
        self._waiters: dict[str, deque[Ticket]] = defaultdict(deque)
        self._gen: OrderedDict[str, int] = OrderedDict()
        self._echoes: dict[str, deque[float]] = defaultdict(deque)  # direct rings, by queue
        self._listener: threading.Thread | None = None
        self._stopping = threading.Event()
        self._subscribed = threading.Event()
        self._pubsub: redis.client.PubSub | None = None
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # see cancel_notice
        self.closed = False  # the node is shutting down: nobody parks any more

    def generation(self, queue: str) -> int:
        with self._lock:
            gen = self._gen.get(queue)
            if gen is None:
                gen = self._gen[queue] = 0
                if len(self._gen) > MAX_NAMES:
                    self._forget()
            else:
                self._gen.move_to_end(queue)
            return gen

    def _forget(self) -> None:
        """Drop the least recently read generations of names nobody waits on (under the
        lock)."""
        for name in list(self._gen)[: len(self._gen) - MAX_NAMES]:
            if not self._waiters.get(name):
                del self._gen[name]

    def _bump(self, queue: str) -> None:
        if queue in self._gen:
            self._gen[queue] += 1

    def _pop_waiter(self, queue: str) -> Ticket | None:
        waiters = self._waiters.get(queue)
        if not waiters:
            return None
        ticket = waiters.popleft()
        if not waiters:
            del self._waiters[queue]
        return ticket

    def waiting(self, queue: str) -> int:
        """Waiters parked on ``queue`` now."""
        with self._lock:
            return len(self._waiters.get(queue, ()))

    def _expect_echo(self, queue: str) -> None:
        if self._listener is not None:
            self._echoes[queue].append(time.monotonic())

    def expect_echo(self, queue: str) -> None:
        """A release of ``queue`` is about to be published by this process, and
        :meth:`ring` will follow it (without ``echo``): the listener swallows that message
        even when it arrives before the ring."""
        with self._lock:
            self._expect_echo(queue)

    def ring(self, queue: str, *, echo: bool = False) -> None:
        """A reservation of ``queue``'s gate may have been freed: wake one of its waiters.
        ``echo``: this release will also be published (finish / requeue), so the listener
        swallows that message instead of waking a second waiter for the same slot."""
        with self._lock:
            self._bump(queue)
            ticket = self._pop_waiter(queue)
            if ticket is not None:
                ticket.rang = True
                ticket.fire()
            if echo:
                self._expect_echo(queue)

    def hand_over(self, queue: str, gate: Any = None) -> Ticket | None:
        """Grant the longest-waiting hand-over ticket of ``queue`` a slot of ``gate`` and wake
        it; None when nobody waits for one of that gate (release the slot instead: right after
        a config reload, a waiter may still ask the gate it was dispatched under). The caller must
        then record the transfer and set ``ticket.held`` / ``ticket.transferred``, and not
        publish a release (the finish / requeue that follows is told ``handed_over``)."""
        with self._lock:
            if self.closed:
                return None
            waiters = self._waiters.get(queue)
            if not waiters or waiters[0].ctx is None or waiters[0].gate is not gate:
                return None
            ticket = self._pop_waiter(queue)
            assert ticket is not None
            ticket.granted = True
            ticket.fire()
            return ticket

    def cancel_notice(self, ids: list[str]) -> None:
        """Running requests were cancelled: remember their ids and wake the waiters parked
        for them (``ticket.cancelled``)."""
        with self._lock:
            for rid in ids:
                self._cancelled[rid] = None
                self._cancelled.move_to_end(rid)
            while len(self._cancelled) > MAX_CANCELLED:
                self._cancelled.popitem(last=False)
            wanted = set(ids)
            for queue in list(self._waiters):
                waiters = self._waiters[queue]
                for ticket in [t for t in waiters if t.rid in wanted]:
                    waiters.remove(ticket)
                    ticket.cancelled = True
                    ticket.fire()
                if not waiters:
                    del self._waiters[queue]

    def cancelled(self, rid: str) -> bool:
        """A cancel notice named ``rid`` lately (the attempt then asks Redis to be sure)."""
        with self._lock:
            return rid in self._cancelled

    def _is_echo(self, queue: str) -> bool:
        """A Pub/Sub message of ``queue`` that a direct ring of this process already rang."""
        with self._lock:
            pending = self._echoes.get(queue)
            if not pending:
                return False
            now = time.monotonic()
            while pending and now - pending[0] > ECHO_S:
                pending.popleft()
            if not pending:
                return False
            pending.popleft()
            return True

    def wait(self, queue: str, generation: int, timeout: float) -> bool:
        """Block until ``queue`` rang after ``generation`` was read, ``timeout`` s passed or
        the bell was closed. True when it rang (or closed)."""
        ticket = self.park(queue, generation, timeout)
        return ticket is None or ticket.rang or ticket.granted

    def park(
        self,
        queue: str,
        generation: int,
        timeout: float,
        ctx: Any = None,
        gate: Any = None,
        rid: str | None = None,
    ) -> Ticket | None:
        """Wait as :meth:`wait` does; with ``ctx`` the waiter may be granted a slot of ``gate``
        by :meth:`hand_over`; with ``rid`` a cancel notice for that request wakes it. None when
        it returned at once (it rang before, or closed), else the ticket: ``granted``,
        ``rang``, ``cancelled``, or none of them (timed out)."""
        if self.closed:
            return None
        self._listen()
        with self._lock:
            if self._gen.get(queue, 0) != generation or self.closed:
                return None
            ticket = Ticket(ctx, gate, rid)
            self._waiters[queue].append(ticket)
        ticket.sleep(timeout)
        with self._lock:
            if not ticket.done:  # timed out, still in line
                ticket.done = True
                waiters = self._waiters[queue]
                waiters.remove(ticket)
                if not waiters:
                    del self._waiters[queue]
        return ticket

    def close(self) -> None:
        """Wake every waiter for good (a warm shutdown: parked attempts go back to their
        queue instead of holding the node up)."""
        self.closed = True
        self._wake_all()

    def _wake_all(self) -> None:
        """Move every queue's generation and wake all its waiters, to ask their gates again."""
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
        """``host:port`` of the listener's Redis connection as the server sees it (CLIENT
        LIST's ``addr``), None while it is not connected."""
        conn = self._pubsub.connection if self._pubsub is not None else None
        sock = getattr(conn, "_sock", None)
        if sock is None:
            return None
        host, port = sock.getsockname()[:2]
        return f"{host}:{port}"

    # -- the Pub/Sub listener -----------------------------------------------------------
    def _listen(self) -> None:
        if self._listener is not None and self._listener.is_alive():
            return
        with self._lock:
            if self._listener is not None and self._listener.is_alive():
                return
            self._listener = threading.Thread(
                target=self._run, name="pipeline-release-bell", daemon=True
            )
            self._listener.start()
        # the first waiter returns once subscribed (or after a short bound): a release
        # published before the subscription would otherwise be missed until its time-out
        self._subscribed.wait(1.0)

    def _run(self) -> None:
        delay = RECONNECT_S[0]
        while not self._stopping.is_set():
            pubsub = self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                self._subscribed.set()
                delay = RECONNECT_S[0]
                while not self._stopping.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is None or message.get("type") != "message":
                        continue
                    data = message.get("data")
                    text = data.decode() if isinstance(data, bytes) else str(data)
                    names = text.split("\n")
                    if names[0] == CANCEL_NOTICE:
                        self.cancel_notice(names[1:])
                        continue
                    for name in names:  # the queue, then quota keys it released
                        if not self._is_echo(name):
                            self.ring(name)
            except Exception as exc:  # noqa: BLE001 - keep listening; waits are bounded
                log.warning("release bell lost its subscription (%s); reconnecting", exc)
                # everything published while away is lost: wake every waiter to re-ask
                self._wake_all()
                self._stopping.wait(delay)
                delay = min(RECONNECT_S[1], delay * 2)
            finally:
                try:  # noqa: SIM105 - as the loop's other handlers
                    pubsub.close()
                except Exception:  # noqa: BLE001 - the connection is gone anyway
                    pass
