"""The patches in ``tasks.compat`` to kombu's Redis transport."""

from __future__ import annotations

from tasks.app import app


def test_a_channel_publishes_through_one_cached_client() -> None:
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        client = channel._create_client()
        assert channel._create_client() is client  # not a new redis.Redis per publish
        assert channel._create_client(asynchronous=True) is not client
        assert client.ping()
    with app.connection_for_write() as conn:
        assert conn.default_channel._create_client() is not client  # a new channel, a new one
