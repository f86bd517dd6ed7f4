"""Connections to the pipeline's Redis."""

from __future__ import annotations

import redis


def connect(url: str) -> redis.Redis:
    """A Redis client with decoded responses, keep-alive and retries on timeouts."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_keepalive=True,
        health_check_interval=30,
        socket_connect_timeout=5,
    )
