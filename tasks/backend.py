"""The Celery result backend of the pipeline's app: Celery's Redis backend, one round trip per
stored state instead of two.

Celery's key-value backends read a task's result before every write (so that a lost, redelivered
task cannot overwrite a SUCCESS). The pipeline already fences every attempt by its token: only
the live attempt of a request stores SUCCESS or FAILURE; a stale one raises ``Ignore`` and stores
nothing. What remains — a late RETRY of an earlier attempt landing after a later attempt's final
state — is handled inside one script (``celery_result.lua``): a non-final state never replaces a
final one. Used when ``CELERY_RESULT_BACKEND`` is a ``redis://``/``rediss://`` URL, and as
:class:`PipelineSentinelBackend` for a ``sentinel://`` list (see ``celeryconfig``: the master's
name is ``PIPELINE_REDIS_SENTINEL_MASTER``); everything else (reading results,
``AsyncResult``) is Celery's own code.

When the result backend is the pipeline's own Redis, an attempt's finish / requeue script also
writes its task's result (:meth:`PipelineRedisBackend.mirror`: the meta Celery would store,
built by Celery's own code) and Celery's store of that state is skipped: one round trip and
one meta encoding less per attempt. A large answer's body is stored once, beside the result:
its meta names it (``payload_ref``) and :meth:`PipelineRedisBackend.meta_from_decoded` reads
it back.
"""

from __future__ import annotations

import json
import threading
from contextlib import suppress
from datetime import UTC, datetime
from typing import Any

import redis
from celery import states
from celery.backends.base import BackendStoreError
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu.utils.encoding import bytes_to_str

from pipeline.errors import UnknownRequest
from pipeline.store import Mirror
from pipeline.store.bodies import with_body
from pipeline.store.connect import CLIENT_POOL, POOL_WAIT_S
from pipeline.store.scripts import source

FINAL = frozenset({states.SUCCESS, states.FAILURE, states.REVOKED})
_RESULT = "__pipeline_result__"  # stands for the result JSON that finish.lua writes


def bounded_pool(**params: Any) -> redis.ConnectionPool:
    """The backend's redis-py pool: one per node (``result_backend_thread_safe``), of at most
    ``redis_max_connections`` (default ``CLIENT_POOL``) connections, where a thread waits for a
    free one instead of raising ``MaxConnectionsError``: a node's connections stay bounded
    whatever its slots."""
    params["max_connections"] = params.get("max_connections") or CLIENT_POOL
    return redis.BlockingConnectionPool(timeout=POOL_WAIT_S, **params)


class PipelineRedisBackend(RedisBackend):
    """``RedisBackend`` whose ``store_result`` is a single script call."""

    @property
    def ConnectionPool(self) -> Any:  # noqa: N802 - Celery's name
        return bounded_pool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store_script = self.client.register_script(source("celery_result"))
        # (task id, state) an attempt's script wrote in this thread, for Celery's store of it
        # that follows in the same thread (the tracer's) to skip: :meth:`mirrored`
        self._written = threading.local()

    def mirror(
        self,
        task_id: str,
        state: str,
        *,
        result: Any = None,
        traceback: str | None = None,
        embed: bool = False,
    ) -> Mirror:
        """The meta Celery would store for ``state``, as a :class:`Mirror` for the attempt's
        finish / requeue script to write (``embed``: the pipeline's result JSON is the
        task's return value, put in place by the script). The fields are those of
        ``_get_result_meta`` for a task with no children, group or parent and no extended
        result (``tasks.inference.mirrors_results``), built directly: Celery's own path costs
        ~0.15 ms per attempt (``tests/integration/test_wire.py`` compares the two)."""
        meta: dict[str, Any] = {
            "status": state,
            "result": _RESULT if embed else self.encode_result(result, state),
            "traceback": traceback,
            "children": [],
            "date_done": datetime.now(UTC).isoformat() if state in states.READY_STATES else None,
            "task_id": task_id,
        }
        value = json.dumps(meta)
        head, tail = value.split(json.dumps(_RESULT), 1) if embed else (value, "")
        expires = self.failure_expires if state == states.FAILURE else self.expires
        return Mirror(
            key=bytes_to_str(self.get_key_for_task(task_id)),
            state=state,
            head=head,
            tail=tail,
            embed=embed,
            ttl=int(expires or 0),
        )

    def mirrored(self, task_id: str, state: str) -> None:
        """An attempt's finish / requeue script wrote ``state`` of ``task_id`` (its
        :meth:`mirror`): Celery's next store of that state, in this thread, is skipped."""
        self._written.last = (task_id, state)

    def meta_from_decoded(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Celery's, and a SUCCESS result whose body was stored apart (``payload_ref``: an
        answer longer than ``PIPELINE_BODY_INLINE_MAX``) gets it back: ``AsyncResult.get()``
        returns the whole result, read or pushed (docs/internals.md, "Large answers")."""
        meta = super().meta_from_decoded(meta)
        result = meta.get("result")
        if meta.get("status") == states.SUCCESS and isinstance(result, dict):
            with suppress(UnknownRequest):  # gone (evicted): the reference is what is left
                meta["result"] = with_body(result, self.client)
        return meta

    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        if getattr(self._written, "last", None) == (bytes_to_str(task_id), state):
            self._written.last = None
            return result  # the attempt's own script wrote it
        meta = self._get_result_meta(
            result=result, state=state, traceback=traceback, request=request
        )
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError(
                "value too large for Redis backend", state=state, task_id=task_id
            )
        expires = self.failure_expires if state == states.FAILURE else self.expires
        args = [value, int(expires or 0), "1" if state in FINAL else "0"]
        key = self.get_key_for_task(task_id)
        self.ensure(self._store_script, ([key], args))
        return result


class PipelineSentinelBackend(PipelineRedisBackend, SentinelBackend):
    """:class:`PipelineRedisBackend` over Celery's ``SentinelBackend``: the client follows the
    master the sentinels name (``result_backend_transport_options["master_name"]``)."""
