"""OpenAI-shaped error answers: ``{"error": {"message", "type", "param", "code"}}`` with the
status codes OpenAI uses, and the one log line each refused request leaves."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from starlette.responses import JSONResponse
from starlette.types import Scope

log = logging.getLogger("pipeline.serve")


class ApiError(Exception):
    """An error answer: raised by a handler, turned into OpenAI's shape by the app."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error = {"message": message, "type": type, "param": param, "code": code}
        self.headers = dict(headers or {})
        if status == 401:
            self.headers["WWW-Authenticate"] = 'Basic realm="pipeline"'

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.error}, status_code=self.status, headers=self.headers)


def log_refusal(scope: Scope, error: ApiError) -> None:
    """One WARNING line for a refused request: method, path as sent (percent-encoded, so a
    caller cannot write a line of its own), status and message; never a header or the query
    string (a key could be there)."""
    path = scope.get("raw_path") or scope.get("path", "").encode()
    log.warning(
        "refused %s %s: %d %s",
        scope.get("method", "-"),
        path.decode("latin-1")[:300],
        error.status,
        printable(str(error.error["message"])),
    )


def printable(text: str) -> str:
    """``text`` with its control characters escaped: a value a caller sent cannot break a
    log line in two."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"File too large: at most {limit} bytes", param="file", code="file_too_large"
    )


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body too large: at most {limit} bytes", code="request_too_large")


def unsupported_media_type(expected: str, got: str | None) -> ApiError:
    said = f"Content-Type {got[:100]!r}" if got else "no Content-Type"
    return ApiError(
        415,
        f"the request body must be {expected}; it came with {said}",
        code="unsupported_media_type",
    )
