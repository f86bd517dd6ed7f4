"""Public value types: :class:`Result` and the :class:`Request` handle."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .explain import Explanation

ERROR_CODES = (
    "DEADLINE_EXCEEDED",
    "CANCELLED",
    "GATE_DROPPED",
    "GATE_ERROR",
    "INFERENCE_ERROR",
    "INVALID_REQUEST",
    "PAYLOAD_UNAVAILABLE",
)
STATES = ("queued", "retry_wait", "dispatched", "running", "done")


@dataclass(frozen=True)
class Result:
    """The terminal result of a request.

    ``status_code`` is the HTTP status when a response arrived (the body is in ``payload``),
    else None with ``error_code``/``error_message`` set and ``payload`` = ``{"error": ...}``.
    Times are Unix seconds.
    """

    id: str
    status_code: int | None
    payload: str
    error_code: str | None = None
    error_message: str | None = None
    attempts: int = 0
    queue: str = ""
    submitted_at: float | None = None
    finished_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error_code is None and self.status_code is not None and self.status_code < 300

    def json(self) -> Any:
        """The payload parsed as JSON."""
        return json.loads(self.payload)

    @property
    def latency_s(self) -> float | None:
        if self.submitted_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.submitted_at

    def to_dict(self) -> dict[str, Any]:
        """The wire form: the reference's fields (``id``, ``status_code``, ``payload``,
        ``error_code``, ``error_message``; absent ones omitted) plus ours."""
        out: dict[str, Any] = {"id": self.id}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        out["payload"] = self.payload
        if self.error_code is not None:
            out["error_code"] = self.error_code
            out["error_message"] = self.error_message or ""
        elif self.error_message:  # an HTTP result's note: the gateway's drop reason
            out["error_message"] = self.error_message
        out.update(
            attempts=self.attempts,
            queue=self.queue,
            submitted_at=self.submitted_at,
            finished_at=self.finished_at,
        )
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        status = data.get("status_code")
        return cls(
            id=str(data["id"]),
            status_code=int(status) if status not in (None, 0) else None,
            payload=data.get("payload", ""),
            error_code=data.get("error_code") or None,
            error_message=data.get("error_message") or None,
            attempts=int(data.get("attempts") or 0),
            queue=data.get("queue") or "",
            submitted_at=data.get("submitted_at"),
            finished_at=data.get("finished_at"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Result:
        return cls.from_dict(json.loads(text))


class RequestSource(Protocol):
    """What a :class:`Request` handle asks of its client (``pipeline.client.Pipeline``)."""

    def state(self, request_id: str) -> str: ...

    def wait(self, request_id: str, timeout: float | None = None) -> Result: ...

    def cancel(self, request_id: str) -> bool: ...

    def record(self, request_id: str) -> dict[str, Any]: ...

    def explain(self, request_id: str) -> Explanation: ...


class Request:
    """A handle on a submitted request. Cheap: it holds only the id and the pipeline."""

    def __init__(self, pipeline: RequestSource, id: str, created: bool = True) -> None:
        self._pipeline = pipeline
        self.id = id
        self.created = created  # False when submit() returned an already live request

    def __repr__(self) -> str:
        return f"Request(id={self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Request) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def state(self) -> str:
        """One of ``queued``, ``retry_wait``, ``dispatched``, ``running``, ``done``."""
        return self._pipeline.state(self.id)

    def result(self, timeout: float | None = None) -> Result:
        """Block until the terminal result arrives; raises TimeoutError after ``timeout`` s."""
        return self._pipeline.wait(self.id, timeout)

    def cancel(self) -> bool:
        """Cancel unless an attempt already started; True when this call cancelled it."""
        return self._pipeline.cancel(self.id)

    def explain(self) -> Explanation:
        """Where the request is and why: its state, its place in its queue (how many ahead, at
        which priorities; in a queue indexed by tenant, its tenant's turn or the quota key
        holding it back), its tenant's quota use and holders, its deadline slack and its
        decision log (gate decisions, retries with status and backoff, requeues), all read
        in one step by the Redis server's clock. ``.to_text()`` for people, ``.to_dict()``
        for JSON. Raises ``UnknownRequest`` once the record is gone."""
        return self._pipeline.explain(self.id)

    def info(self) -> dict[str, Any]:
        """The raw request record (for debugging)."""
        return self._pipeline.record(self.id)


def now() -> float:
    return time.time()
