"""The Celery application, configured from ``celeryconfig``."""

from __future__ import annotations

import os

from celery import Celery

from pipeline import keys

from . import compat

compat.install()
app = Celery("pipeline")
app.config_from_object("celeryconfig")


def _prefix() -> str:
    return os.environ.get("PIPELINE_KEY_PREFIX") or "pl:"


def celery_queue(pool: str) -> str:
    """The Celery queue that carries a worker pool's attempts (see ``pipeline.keys``)."""
    return keys.celery_queue(pool, _prefix())


def pool_of(celery_queue_name: str) -> str | None:
    """The worker pool a Celery queue of this pipeline carries, or None."""
    start = keys.celery_queue_prefix(_prefix())
    return celery_queue_name[len(start) :] if celery_queue_name.startswith(start) else None
