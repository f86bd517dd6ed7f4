"""The batch object: OpenAI's ``Batch`` fields and statuses, read from its Redis record."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..client.api import MAX_DEADLINE_AHEAD_S
from ..errors import InvalidRequest, PipelineError

STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
FINAL = frozenset({"failed", "completed", "expired", "cancelled"})
STATUS_TIMES = tuple(f"{status}_at" for status in STATUSES[1:])  # when it took each status
TIMES = ("created_at", "expires_at", *STATUS_TIMES)
_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class UnknownBatch(PipelineError, KeyError):
    """No batch with that id is known (never created, or expired after its retention)."""


class UnknownFile(PipelineError, KeyError):
    """No file with that id is known (never uploaded, deleted, or expired)."""


class FileElsewhere(PipelineError):
    """A file's bytes are in another file store than this one (``pipeline serve`` processes on
    one Redis with different ``PIPELINE_FILES_DIR``): only a service on that store can read or
    delete them. ``file_id``, ``store`` (the file's store id), ``here`` (this one's)."""

    def __init__(self, file_id: str, store: str, here: str) -> None:
        super().__init__(
            f"file {file_id} is kept in file store {store}, not in this service's ({here}): "
            "every pipeline serve on one Redis must share one PIPELINE_FILES_DIR "
            "(docs/batches.md, 'Several services on one Redis')"
        )
        self.file_id, self.store, self.here = file_id, store, here


class IngestFailed(PipelineError):
    """Reading or storing a batch's lines raised an unexpected error (``reason``; the
    exception is the ``__cause__``). ``final``: the batch gave up after ``tries`` tries — it is
    ``failed`` with the reason in its ``errors`` (a running one stops taking lines and is
    ``failed`` once its stored lines end); else it is tried again after ``retry_in_s``."""

    def __init__(
        self,
        batch_id: str,
        reason: str,
        *,
        tries: int,
        allowed: int,
        retry_in_s: float = 0.0,
        status: str = "failed",
    ) -> None:
        self.batch_id, self.reason = batch_id, reason
        self.tries, self.allowed, self.retry_in_s = tries, allowed, retry_in_s
        self.final = tries >= allowed
        if not self.final:
            then = f"again in {retry_in_s:g} s"
        elif status in ("in_progress", "finalizing"):  # some lines were stored: they run
            then = "the batch takes no more lines and ends failed"
        else:
            then = f"the batch is {status}"
        super().__init__(
            f"batch {batch_id}: storing its lines failed (try {tries} of {allowed}; {then}): "
            f"{reason}"
        )


def window_seconds(window: str | float | int) -> float:
    """A completion window as seconds: ``"24h"`` (OpenAI's only value), ``"90m"``, ``"2d"``,
    ``"30s"``, or a number of seconds."""
    if isinstance(window, int | float) and not isinstance(window, bool):
        seconds = float(window)
    elif isinstance(window, str) and (m := _WINDOW.match(window)):
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    else:
        raise InvalidRequest(
            "completion_window", f"must be like '24h', '90m' or seconds, not {window!r}"
        )
    if not 0 < seconds <= MAX_DEADLINE_AHEAD_S:
        raise InvalidRequest("completion_window", "must be a positive duration up to 10 years")
    return seconds


@dataclass(frozen=True)
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0

    @property
    def done(self) -> int:
        return self.completed + self.failed


class BatchSource(Protocol):
    """What a :class:`Batch` handle asks of its client (:class:`pipeline.batch.Batches`)."""

    def get(self, batch_id: str) -> Batch: ...

    def cancel(
        self, batch_id: str, owner: str | None = None, *, running: str = "finish"
    ) -> Batch: ...

    def wait(self, batch_id: str, timeout: float | None = None) -> Batch: ...


@dataclass(frozen=True)
class Batch:
    """A batch as it was when read. Times are Unix s by the Redis server's clock (None until
    they happen); ``expires_at`` is every line's deadline."""

    id: str
    status: str
    endpoint: str
    completion_window: str
    input_file_id: str | None
    request_counts: RequestCounts
    created_at: float
    expires_at: float
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    owner: str = ""
    queue: str = "default"
    lines: int = 0  # the input's last line number (known once validated)
    submitted: int = 0  # input lines enqueued so far (line numbers 1..submitted)
    source: dict[str, Any] = field(default_factory=dict)
    files: bool = False  # its output and error files are assembled by `pipeline serve`
    store: str = ""  # ... in this file store (its input's; "" for a batch from before stores)
    gave_up: bool = False  # its lines could not all be stored (see ``errors``): it ends failed
    _client: BatchSource = field(kw_only=True, repr=False, compare=False)

    @property
    def done(self) -> bool:
        """Closed: completed, expired, cancelled or failed (its counts no longer change)."""
        return self.status in FINAL

    def request_id(self, line: int) -> str:
        """The pipeline request id of input line ``line`` (see ``GET /v1/requests/{id}``)."""
        return f"{self.id}-{line}"

    # -- the handle -----------------------------------------------------------------------
    def refresh(self) -> Batch:
        return self._client.get(self.id)

    def cancel(self, running: str = "finish") -> Batch:
        """Cancel every line that has not started an attempt; the batch is ``cancelling``
        until the attempts in flight have finished, then ``cancelled``. ``running="abort"``
        ends those attempts too, closing their calls' connections (a model server stops
        generating): the batch is ``cancelled`` at once. Returns it afterwards."""
        return self._client.cancel(self.id, running=running)

    def wait(self, timeout: float | None = None) -> Batch:
        """Block until the batch is closed; raises TimeoutError after ``timeout`` s."""
        return self._client.wait(self.id, timeout)

    # -- wire forms -----------------------------------------------------------------------
    @classmethod
    def from_record(cls, rec: dict[str, str], client: BatchSource) -> Batch:
        times: dict[str, Any] = {t: float(rec[t]) if rec.get(t) else None for t in STATUS_TIMES}
        counts = RequestCounts(
            int(rec.get("total") or 0), int(rec.get("completed") or 0), int(rec.get("failed") or 0)
        )
        return cls(
            id=rec["id"],
            status=rec.get("status", "validating"),
            endpoint=rec.get("endpoint", ""),
            completion_window=rec.get("completion_window", ""),
            input_file_id=rec.get("input_file_id") or None,
            request_counts=counts,
            created_at=float(rec.get("created_at") or 0),
            expires_at=float(rec.get("expires_at") or 0),
            **times,
            output_file_id=rec.get("output_file_id") or None,
            error_file_id=rec.get("error_file_id") or None,
            errors=json.loads(rec["errors"]) if rec.get("errors") else None,
            metadata=json.loads(rec["metadata"]) if rec.get("metadata") else None,
            model=rec.get("model") or None,
            owner=rec.get("owner", ""),
            queue=rec.get("queue", "default"),
            lines=int(rec.get("lines") or 0),
            submitted=int(rec.get("submitted") or 0),
            source=json.loads(rec["source"]) if rec.get("source") else {},
            files=rec.get("files") == "1",
            store=rec.get("store", ""),
            gave_up=rec.get("gave_up") == "1",
            _client=client,
        )

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``Batch`` object (times as integer Unix seconds)."""
        c = self.request_counts
        out: dict[str, Any] = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id or "",
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
        }
        for name in TIMES:
            value = getattr(self, name)
            out[name] = None if value is None else int(value)
        out["request_counts"] = {"total": c.total, "completed": c.completed, "failed": c.failed}
        out["metadata"] = self.metadata
        return out
