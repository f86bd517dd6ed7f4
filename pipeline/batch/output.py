"""A batch's results, line by line in input order: OpenAI's output and error file lines (their
shapes and error codes: docs/batches.md, "Errors and output lines") or ``pipeline run``'s."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson

from ..client import Result

MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was cancelled before it started.",
    "batch_failed": "This request was never stored: reading the batch's input failed (see the "
    "batch's errors).",
}


@dataclass
class LineResult:
    """One input line's outcome: ``data`` (its stored :class:`Result`), the ``invalid`` record
    of an invalid line (or of one whose id a live request of other content held: its code
    ``idempotency_conflict``), or ``missing``: the error code of a line never stored."""

    number: int
    request_id: str
    custom_id: str | None
    data: dict[str, Any] | None = None
    invalid: dict[str, Any] | None = None
    missing: str | None = None

    @cached_property
    def result(self) -> Result | None:
        return None if self.data is None else Result.from_dict(self.data)

    @property
    def conflict(self) -> bool:
        """An error line because its id was live with other content (submit.lua)."""
        return self.invalid is not None and self.invalid.get("code") == "idempotency_conflict"

    @property
    def ok(self) -> bool:
        d = self.data
        if d is None or d.get("error_code"):
            return False
        status = d.get("status_code")
        return isinstance(status, int) and status < 300

    def error(self) -> tuple[str, str]:
        """A line that did not run: the pipeline's error code and message."""
        if self.invalid is not None:
            code = "IDEMPOTENCY_CONFLICT" if self.conflict else "INVALID_REQUEST"
            return code, str(self.invalid["message"])
        if self.missing == "batch_expired":
            return "DEADLINE_EXCEEDED", MESSAGES["batch_expired"]
        return "CANCELLED", MESSAGES[self.missing or "batch_cancelled"]


def openai_line(line: LineResult, batch_status: str) -> bytes:
    """OpenAI's output (ok) or error file line."""
    out: dict[str, Any] = {"id": line.request_id, "custom_id": line.custom_id}
    d = line.data
    status = d.get("status_code") if d is not None else None
    if d is not None and status:
        body = d.get("payload", "")  # the text as it came when it is not JSON
        with suppress(orjson.JSONDecodeError):
            body = orjson.loads(body)
        out["response"] = {"status_code": status, "request_id": line.request_id, "body": body}
    else:
        out["response"] = None
    if line.ok:
        out["error"] = None
    elif d is not None and not d.get("error_code"):
        message = f"HTTP {status} after {d.get('attempts', 0)} attempt(s)"
        out["error"] = {"code": "http_error", "message": message}
    elif d is not None:
        code = str(d["error_code"]).lower()
        if d["error_code"] == "DEADLINE_EXCEEDED" and batch_status == "expired":
            code = "batch_expired"
        elif d["error_code"] == "CANCELLED":
            code = "batch_cancelled"
        message = MESSAGES.get(code) or d.get("error_message") or code
        out["error"] = {"code": code, "message": message}
    elif line.invalid is not None:
        out["error"] = {"code": line.invalid["code"], "message": line.invalid["message"]}
    else:
        code = line.missing or "batch_cancelled"
        out["error"] = {"code": code, "message": MESSAGES[code]}
    return orjson.dumps(out) + b"\n"


def result_line(line: LineResult) -> bytes:
    """``pipeline run``'s result line: the :class:`Result` fields, ``id`` being the line's
    custom_id (or ``id``), plus ``custom_id`` and the pipeline's ``request_id``."""
    key = line.custom_id or f"line-{line.number}"
    if line.result is not None:
        row = line.result.to_dict()
    else:
        code, message = line.error()
        row = {
            "payload": orjson.dumps({"error": message}).decode(),
            "error_code": code,
            "error_message": message,
        }
    row["id"] = key
    row["custom_id"] = line.custom_id
    row["request_id"] = line.request_id
    return orjson.dumps(row) + b"\n"
