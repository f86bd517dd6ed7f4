"""The Celery application, configured from the ``celeryconfig.py`` installed beside this package
(read by its location: ``tasks/config.py``)."""

from __future__ import annotations

from typing import Any

from celery import Celery

from pipeline.config import key_prefix
from pipeline.store import keys

from .backend import PipelineRedisBackend, PipelineSentinelBackend


class PipelineCelery(Celery):
    """Celery, with :class:`~tasks.backend.PipelineRedisBackend` for a Redis result backend
    (:class:`~tasks.backend.PipelineSentinelBackend` for a ``sentinel://`` list; the
    ``CELERY_RESULT_BACKEND`` environment variable wins over ``celeryconfig`` in Celery, so the
    class is picked here, when the backend is first used)."""

    def _get_backend(self) -> Any:
        url = str(self.conf.result_backend)
        if self.backend_cls is None and url.startswith(("redis://", "rediss://")):
            return PipelineRedisBackend(app=self, url=url)
        if self.backend_cls is None and url.startswith("sentinel://"):
            return PipelineSentinelBackend(app=self, url=url)
        return super()._get_backend()


app = PipelineCelery("pipeline")
# by the file's location, under the pipeline's own name: never a celeryconfig module that
# happens to come first on sys.path (Celery puts the working directory there)
app.config_from_object("tasks.config:settings")


def celery_queue(pool: str) -> str:
    """The Celery queue that carries a worker pool's attempts (see ``pipeline.keys``)."""
    return keys.celery_queue(pool, key_prefix())


def pool_of(celery_queue_name: str) -> str | None:
    """The worker pool a Celery queue of this pipeline carries, or None."""
    start = keys.celery_queue_prefix(key_prefix())
    return celery_queue_name[len(start) :] if celery_queue_name.startswith(start) else None
