"""A batch's results, line by line, in input order: OpenAI's output and error file lines, or
``pipeline run``'s result lines (the pipeline's own :class:`~pipeline.client.Result` shape).

OpenAI's shapes: an output line (a 2xx/3xx answer) is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}``; an
error line has ``"error": {"code", "message"}`` and the ``response`` when the model server
answered (an HTTP error after retries), else ``null``. Error codes:

============================== =====================================================
``http_error``                 the server answered 4xx, or 429/5xx until the deadline
``batch_expired``              the completion window passed before it ran
``batch_cancelled``            the batch was cancelled before it started
``deadline_exceeded``          a line's own, shorter deadline passed (``pipeline run``)
``invalid_request`` and others a bad line (its validation code), or the pipeline's own
                               error code in lower case (``gate_dropped``, ...)
============================== =====================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from ..client import Result
from .model import Batch
from .records import BatchRecords

MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was cancelled before it started.",
}


@dataclass(frozen=True)
class LineResult:
    """One input line's outcome: ``ok`` (2xx/3xx), its ``result`` when it ran, the
    validation ``error`` of an invalid line, or ``missing`` (never stored: cancelled or
    expired before it was enqueued)."""

    number: int
    request_id: str
    custom_id: str | None
    result: Result | None = None
    invalid: dict[str, Any] | None = None
    missing: str | None = None  # the error code of a line never stored

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok


def line_results(
    records: BatchRecords,
    batch: Batch,
    custom_ids: Callable[[int], dict[int, str]] | None = None,
) -> Iterator[LineResult]:
    """Every request line of ``batch`` in input order. Lines after the last one stored
    (cancelled or lapsed before they were enqueued) are known only from the input:
    ``custom_ids(after)`` maps their line numbers to custom_ids (None: left out)."""
    invalid = {int(r["line"]): r for r in records.invalid(batch.id)}
    last = batch.submitted
    missing_code = (
        "batch_cancelled" if batch.status in ("cancelled", "cancelling") else ("batch_expired")
    )
    for lo in range(1, last + 1, 5000):
        hi = min(last, lo + 4999)
        for offset, (res, cid) in enumerate(records.results(batch.id, lo, hi)):
            n = lo + offset
            rid = batch.request_id(n)
            if res is not None:
                yield LineResult(n, rid, cid, Result.from_dict(orjson.loads(res)))
            elif n in invalid:
                yield LineResult(n, rid, invalid[n].get("custom_id"), invalid=invalid[n])
    if batch.lines > last:
        rest = custom_ids(last) if custom_ids is not None else {}
        for n in range(last + 1, batch.lines + 1):
            if n in invalid:
                yield LineResult(n, batch.request_id(n), invalid[n].get("custom_id"),
                                 invalid=invalid[n])  # fmt: skip
            elif n in rest:
                yield LineResult(n, batch.request_id(n), rest[n], missing=missing_code)


def _body(payload: str) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload  # not JSON: the text as it came


def error_code(result: Result, batch_status: str) -> str:
    code = result.error_code
    if code is None:
        return "http_error"
    if code == "DEADLINE_EXCEEDED":
        return "batch_expired" if batch_status == "expired" else "deadline_exceeded"
    if code == "CANCELLED":
        return "batch_cancelled"
    return code.lower()


def openai_line(line: LineResult, batch_status: str) -> bytes:
    """OpenAI's output (ok) or error file line."""
    out: dict[str, Any] = {"id": line.request_id, "custom_id": line.custom_id}
    r = line.result
    if r is not None and r.status_code is not None:
        out["response"] = {
            "status_code": r.status_code,
            "request_id": line.request_id,
            "body": _body(r.payload),
        }
    else:
        out["response"] = None
    if line.ok:
        out["error"] = None
    elif r is not None:
        code = error_code(r, batch_status)
        if r.error_code is None:
            message = f"HTTP {r.status_code} after {r.attempts} attempt(s)"
        else:
            message = MESSAGES.get(code) or r.error_message or code
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
        if line.invalid is not None:
            code, message = "INVALID_REQUEST", str(line.invalid["message"])
        elif line.missing == "batch_expired":
            code, message = "DEADLINE_EXCEEDED", MESSAGES["batch_expired"]
        else:
            code, message = "CANCELLED", MESSAGES["batch_cancelled"]
        row = {
            "payload": orjson.dumps({"error": message}).decode(),
            "error_code": code,
            "error_message": message,
        }
    row["id"] = key
    row["custom_id"] = line.custom_id
    row["request_id"] = line.request_id
    return orjson.dumps(row) + b"\n"
