"""The Dramatiq comparison (target 5): one actor that POSTs to the simulator under Dramatiq's
``ConcurrentRateLimiter`` (a Redis counter with a TTL), the documented way::

    with LIMITER.acquire():      # RateLimitExceeded when full -> Retries middleware backoff
        POST ...

(``RateLimitExceeded`` must not be in the actor's ``throws``: those are never retried.)

A full limiter raises ``RateLimitExceeded`` and the ``Retries`` middleware re-delivers the
message after ``min_backoff``..``max_backoff`` (exponential, jittered; set from
``BENCH_DRAMATIQ_MIN_BACKOFF_MS`` / ``BENCH_DRAMATIQ_MAX_BACKOFF_MS``, 100 / 1000 by default:
far below Dramatiq's 15 s default, and about the pipeline's own refusal delay of 0.2-1 s). A
429/5xx answer is retried the same way (the message is re-delivered).

Worker: ``python -m dramatiq bench.dramatiq_app --processes 1 --threads 64`` with
``BENCH_REDIS_URL`` and ``BENCH_LIMIT`` set (see ``bench/vs_dramatiq.py``).
"""

from __future__ import annotations

import os
import threading

import dramatiq
import httpx
from dramatiq.brokers.redis import RedisBroker
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend

QUEUE = "bench"
URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
LIMIT = int(os.environ.get("BENCH_LIMIT", "16"))
MIN_BACKOFF_MS = int(os.environ.get("BENCH_DRAMATIQ_MIN_BACKOFF_MS", "100"))
MAX_BACKOFF_MS = int(os.environ.get("BENCH_DRAMATIQ_MAX_BACKOFF_MS", "1000"))

broker = RedisBroker(url=URL)
dramatiq.set_broker(broker)
LIMITER = ConcurrentRateLimiter(RedisBackend(url=URL), "bench-limit", limit=LIMIT)

_shared: httpx.Client | None = None
_lock = threading.Lock()


def http() -> httpx.Client:
    global _shared
    with _lock:
        if _shared is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            _shared = httpx.Client(limits=limits, trust_env=False)
        return _shared


class RetriableStatus(Exception):
    """The simulator answered 429 or 5xx: let the Retries middleware try again."""


@dramatiq.actor(
    queue_name=QUEUE,
    max_retries=10_000,
    min_backoff=MIN_BACKOFF_MS,
    max_backoff=MAX_BACKOFF_MS,
)
def infer(url: str, body: str, headers: dict[str, str]) -> None:
    with LIMITER.acquire():
        resp = http().post(url, content=body.encode(), headers=headers, timeout=30)
    if resp.status_code == 429 or resp.status_code >= 500:
        raise RetriableStatus(str(resp.status_code))
