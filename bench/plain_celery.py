"""The plain-Celery baseline: a minimal Celery app whose task POSTs one request to the simulator
and returns its status code. No gate, no sorted set, no dispatcher: the client calls
``apply_async`` and the worker runs it. Same broker and result backend (Redis), JSON only, late
acks with prefetch 1 per slot, like the pipeline's ``celeryconfig``; Celery's defaults
otherwise (no task events).

Worker: ``celery -A bench.plain_celery worker -P threads -c 64 -Q plainbench`` with
``BENCH_REDIS_URL`` set (see ``bench/overhead.py``).
"""

from __future__ import annotations

import os
import threading

import httpx
from celery import Celery

QUEUE = "plainbench"
_url = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")

app = Celery("plainbench")
app.conf.update(
    broker_url=_url,
    result_backend=_url,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_accept_content=["json"],
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=3600,
)

_shared: httpx.Client | None = None
_lock = threading.Lock()


def http() -> httpx.Client:
    """One client per process (as the pipeline's worker has)."""
    global _shared
    with _lock:
        if _shared is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            _shared = httpx.Client(limits=limits, trust_env=False)
        return _shared


@app.task(name="plainbench.post")
def post(url: str, body: str, headers: dict[str, str]) -> int:
    resp = http().post(url, content=body.encode(), headers=headers, timeout=30)
    return resp.status_code
