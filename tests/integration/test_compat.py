"""The patches in ``tasks.compat``, each on the pinned kombu: what it changes, observed on a real
Redis (the no-ack ack is checked in ``tests/integration/test_wire.py``)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tasks import compat
from tasks.app import app


@pytest.fixture(autouse=True)
def patched() -> None:
    compat.install()  # as a worker node does at worker_init (tasks/node.py)


def test_a_channel_whose_connection_is_gone_fails_with_a_connection_error() -> None:
    """A worker that acks, losing Redis: Celery drops the lost connection's client, then closes
    the connection (its channel restores its unacked messages) and acks messages delivered on
    it. Both built a client from the dropped one and raised AttributeError, which stopped the
    worker; a connection error is what Celery's handlers expect (they log it and go on), and
    the messages stay in kombu's unacked set, for redelivery after the visibility timeout."""
    name = f"compat-closed-{uuid.uuid4().hex[:8]}"
    conn = app.connection_for_write()
    channel = conn.channel()
    client = channel.client
    tags: list[str] = []
    try:
        for i in range(2):
            channel.basic_publish(channel.prepare_message(json.dumps({"i": i})), "", name)
        got: list[Any] = []
        channel.basic_consume(name, False, got.append, "compat-closed")
        conn.drain_events(timeout=5)
        conn.drain_events(timeout=5)
        tags = [m.delivery_tag for m in got]
        assert len(tags) == 2 and set(channel.qos._delivered) == set(tags)
        conn.transport.client = None  # what Celery's release of the lost connection leaves
        conn.maybe_close_channel(channel)  # kombu's close, which ignores connection errors
        assert channel.closed
        with pytest.raises(RedisConnectionError):
            got[1].ack()  # a message delivered on it, acked when its task ends
        assert all(client.hexists(channel.unacked_key, t) for t in tags)
        assert client.llen(name) == 0
    finally:
        for tag in tags:
            client.hdel(channel.unacked_key, tag)
            client.zrem(channel.unacked_index_key, tag)
        client.delete(name)


def test_a_no_ack_brpop_takes_a_batch_bounded_by_free_slots() -> None:
    """A no-ack consumer's BRPOP has an RPOP with a count behind it: the messages come in the
    list's order, at most the node's free slots in all; with no bound, or for a queue the node
    does not consume no-ack, one per BRPOP."""
    name = f"compat-batch-{uuid.uuid4().hex[:8]}"
    got: list[int] = []
    before = compat._room, compat._queues
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        try:
            for i in range(7):
                channel.basic_publish(channel.prepare_message(json.dumps({"i": i})), "", name)
            channel.basic_consume(
                name, True, lambda m: got.append(json.loads(m.body)["i"]), "compat-batch"
            )
            compat.bound_batches(lambda: 3, {name})
            conn.drain_events(timeout=5)
            assert got == [0, 1, 2]  # the BRPOP's and two more
            compat.bound_batches(None)
            conn.drain_events(timeout=5)
            assert got == [0, 1, 2, 3]  # one
            compat.bound_batches(lambda: 100, {"another-queue"})
            conn.drain_events(timeout=5)
            assert got == [0, 1, 2, 3, 4]  # one
            compat.bound_batches(lambda: 100, {name})
            conn.drain_events(timeout=5)
            assert got == [0, 1, 2, 3, 4, 5, 6]  # what was left
            assert channel.client.llen(name) == 0
        finally:
            compat.bound_batches(*before)
            channel.client.delete(name)
