"""Exceptions raised by the pipeline. Catch :class:`PipelineError` for all of them."""

from __future__ import annotations


class PipelineError(Exception):
    """Root of every error this package raises on purpose."""


class InvalidRequest(PipelineError, ValueError):
    """A submission (or another call's argument) was rejected; ``field`` names the offending
    argument, ``item`` the index of the offending item of a ``submit_many``."""

    def __init__(self, field: str, message: str, item: int | None = None) -> None:
        where = f"item {item}: " if item is not None else ""
        super().__init__(f"{field}: {where}{message}")
        self.field = field
        self.item = item
        self.reason = message


class ConfigError(PipelineError):
    """The queue or pool configuration is invalid (raised at startup, naming the entry);
    ``field``: the setting, when one ``configure()`` was given is the cause."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class IdempotencyConflict(PipelineError, ValueError):
    """A submission reused the id of a live request with another payload, queue, endpoint or
    headers; nothing was stored for it. ``request_id`` names the id, ``differs`` what is not
    the same; ``stored`` (``submit_many``): the ids of the batch's other items, which were
    stored or found live as usual."""

    def __init__(self, request_id: str, differs: list[str], stored: list[str] | None = None):
        super().__init__(
            f"request {request_id!r} is live with another {' and '.join(differs)}: submit the "
            "same content again, wait for it to end, or use another id"
        )
        self.request_id = request_id
        self.differs = differs
        self.stored = stored or []


class UnknownRequest(PipelineError, KeyError):
    """No request with that id is known (never submitted, or its result has expired)."""


class ReplicationError(PipelineError):
    """A write reached the Redis master but not ``wanted`` replicas within ``timeout_ms``
    (``PIPELINE_REDIS_MIN_REPLICAS`` / ``PIPELINE_REDIS_WAIT_TIMEOUT_MS``): it stands on the
    master, but a failover now could lose it. ``acked`` replicas confirmed it. Raised by
    ``submit``: submitting the same ids again is safe (a live id is not stored twice)."""

    def __init__(self, what: str, wanted: int, acked: int, timeout_ms: int) -> None:
        super().__init__(
            f"{what}: stored on the Redis master, but {acked} of the {wanted} replica(s) "
            f"PIPELINE_REDIS_MIN_REPLICAS asks for confirmed it within {timeout_ms} ms; it "
            "could be lost if the master fails now. Submitting the same ids again is safe."
        )
        self.what, self.wanted, self.acked, self.timeout_ms = what, wanted, acked, timeout_ms
        self.ids: list[str] = []  # the submitted ids, when the client knows them


class UnsafeRedis(ConfigError):
    """The pipeline's Redis is configured in a way that breaks its guarantees (a
    ``maxmemory-policy`` that evicts keys, a Redis Cluster node); the message names the
    setting and the fix."""


class StoreFull(PipelineError):
    """The pipeline's Redis refused a write: it is at its ``maxmemory`` (``noeviction``, the
    policy the pipeline needs). ``submit_many`` stores in chunks, each all or nothing
    (docs/internals.md, "submit_many in growing chunks"): ``stored`` names the ids of the
    chunks that went in before the refusal (created, or found live), ``not_stored`` the rest;
    submitting ``not_stored`` again once memory is freed is safe (as is all of them: a live id
    is not stored twice)."""

    def __init__(self, what: str, stored: list[str] | None = None,
                 not_stored: list[str] | None = None) -> None:  # fmt: skip
        self.stored = stored or []
        self.not_stored = not_stored or []
        done = f"; {len(self.stored)} stored before it, {len(self.not_stored)} not" if (
            self.stored or self.not_stored) else ""  # fmt: skip
        super().__init__(
            f"{what}: Redis is at its maxmemory and refused the write{done} (free memory or "
            "raise maxmemory, then submit the ids not stored again)"
        )
        self.what = what


class StateLost(PipelineError):
    """The pipeline's Redis lost its state since this client (or node) last saw it: its store
    epoch (docs/production.md, "A wiped Redis") is gone or changed, as after a restart without
    persistence or a ``FLUSHALL``. ``ids``: the requests asked about whose records went with
    it (their outcome is unknown: submit them again); ``noticed_at``: when the loss was first
    noticed (Unix s, the Redis server's clock), if known. Not an :class:`UnknownRequest`: the
    id was accepted; its record did not survive."""

    def __init__(self, ids: list[str], noticed_at: float | None = None) -> None:
        shown = ", ".join(repr(i) for i in ids[:5]) + (" ..." if len(ids) > 5 else "")
        super().__init__(
            f"the pipeline's Redis lost its state (restarted without persistence, or "
            f"flushed): {len(ids)} accepted request(s) are gone ({shown}); submit them again"
        )
        self.ids = ids
        self.noticed_at = noticed_at
