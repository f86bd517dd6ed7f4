"""The terminal result of a request, as stored and as handed out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Result:
    """The terminal result of a request: ``status_code`` and the body in ``payload`` when a
    response arrived, else ``error_code``/``error_message`` and ``payload`` ``{"error": ...}``."""

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
        """A result from its JSON form. One whose body was stored apart and not read back
        (``payload_ref``, see :meth:`Pipeline.load_result`) has an empty ``payload`` and the
        body's key in ``extra["payload_ref"]``."""
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
            extra={"payload_ref": data["payload_ref"]} if "payload_ref" in data else {},
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Result:
        return cls.from_dict(json.loads(text))
