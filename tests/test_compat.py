"""The patches in ``tasks.compat``, each on the pinned kombu: what it changes, observed on a real
Redis (the no-ack ack is checked in ``tests/test_wire.py``)."""

from __future__ import annotations

import json
import logging
import uuid

import pytest

from tasks import compat
from tasks.app import app


def test_a_channel_whose_connection_is_gone_leaves_its_unacked_messages_for_redelivery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that acks, losing Redis: Celery closes the lost connection after it dropped
    the connection's client, and closing a channel restores its unacked messages through a
    client built from it. kombu raised AttributeError there (the worker stopped); the message
    stays in kombu's unacked set instead, for redelivery after the visibility timeout."""
    name = f"compat-restore-{uuid.uuid4().hex[:8]}"
    conn = app.connection_for_write()
    channel = conn.channel()
    client = channel.client
    tag = None
    try:
        channel.basic_publish(channel.prepare_message(json.dumps({"i": 1})), "", name)
        got: list[object] = []
        channel.basic_consume(name, False, got.append, "compat-restore")
        conn.drain_events(timeout=5)
        assert len(got) == 1 and len(channel.qos._delivered) == 1
        tag = next(iter(channel.qos._delivered))
        conn.transport.client = None  # what kombu's Connection leaves when it is released
        with caplog.at_level(logging.WARNING, "pipeline.compat"):
            channel.close()
        assert "leaving 1 unacked message(s)" in caplog.text
        assert client.hexists(channel.unacked_key, tag)  # redelivered after the timeout
        assert client.llen(name) == 0
    finally:
        if tag is not None:
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
