"""The Celery application, configured from ``celeryconfig``."""

from __future__ import annotations

from celery import Celery

app = Celery("pipeline")
app.config_from_object("celeryconfig")

CELERY_QUEUE_PREFIX = "pipeline."


def celery_queue(pool: str) -> str:
    """The Celery queue that carries a worker pool's attempts."""
    return f"{CELERY_QUEUE_PREFIX}{pool}"
