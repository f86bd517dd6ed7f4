"""Input lines of a batch, checked one at a time: OpenAI Batch API lines, or with
``extensions`` the ``pipeline run`` forms (docs/batches.md). A :class:`LineError`'s code and
message are what the batch's ``errors`` or error file show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ..client.api import check_endpoint
from ..errors import InvalidRequest

# the endpoints OpenAI's Batch API accepts, which an OpenAI-compatible server may serve
KNOWN_URLS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/moderations",
    }
)
MAX_CUSTOM_ID = 512
EXTENSIONS = frozenset({"priority", "deadline", "timeout", "metadata", "headers", "queue"})
OPENAI_KEYS = frozenset({"custom_id", "method", "url", "body"})
RUN_KEYS = frozenset({"id", "payload", "endpoint"})


@dataclass(frozen=True)
class Line:
    """A valid line: ``body`` as compact JSON text; ``extra`` its run extensions, if any."""

    number: int
    custom_id: str
    url: str | None
    body: str
    model: str | None = None
    extra: dict[str, Any] | None = None


@dataclass(frozen=True)
class LineError:
    """Why line ``number`` is not a request (with its custom_id when it could be read)."""

    number: int
    code: str
    message: str
    param: str | None = None
    custom_id: str | None = None

    def as_error(self) -> dict[str, Any]:
        """The entry of a batch's ``errors.data``."""
        return {
            "code": self.code,
            "line": self.number,
            "message": self.message,
            "param": self.param,
        }


def parse_line(
    number: int,
    raw: bytes,
    *,
    endpoint: str | None,
    max_body_bytes: int,
    extensions: bool,
) -> Line | LineError:
    """Check one input line. ``endpoint``: the only ``url`` allowed (None: any known url)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return LineError(number, "invalid_json_line", f"line {number}: not JSON: {exc}")
    if not isinstance(obj, dict):
        return LineError(number, "invalid_json_line", f"line {number}: not a JSON object")
    run = extensions and "payload" in obj and "body" not in obj  # a line of submit arguments
    id_key, body_key = ("id", "payload") if run else ("custom_id", "body")
    custom_id = obj.get("id", f"line-{number}") if run else obj.get("custom_id")
    cid = custom_id if isinstance(custom_id, str) else None
    known = (RUN_KEYS if run else OPENAI_KEYS) | (EXTENSIONS if extensions else frozenset())
    try:
        _check_custom_id(custom_id, id_key)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise _Bad(f"unknown field {unknown[0]!r}", "invalid_request", unknown[0])
        url = _run_endpoint(obj) if run else _check_method_url(obj, endpoint, extensions)
        body = _body_text(obj[body_key], max_body_bytes, body_key)
    except _Bad as bad:
        if run and bad.param == "id":
            cid = None
        return LineError(number, bad.code, f"line {number}: {bad.message}", bad.param, cid)
    assert cid is not None
    model = obj[body_key].get("model")
    extra = {k: obj[k] for k in EXTENSIONS if k in obj}
    return Line(number, cid, url, body, model if isinstance(model, str) else None, extra or None)


class _Bad(Exception):
    def __init__(self, message: str, code: str, param: str) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


def _check_custom_id(custom_id: Any, key: str) -> None:
    if custom_id is None:
        raise _Bad(f"missing {key}", "missing_required_parameter", key)
    if not isinstance(custom_id, str) or not custom_id:
        raise _Bad(f"{key} must be a non-empty string", "invalid_custom_id", key)
    if len(custom_id) > MAX_CUSTOM_ID:
        raise _Bad(f"{key} longer than {MAX_CUSTOM_ID} characters", "invalid_custom_id", key)


def _run_endpoint(obj: dict[str, Any]) -> str | None:
    try:
        return check_endpoint(obj.get("endpoint")) or None
    except InvalidRequest as exc:
        raise _Bad(str(exc), "invalid_url", "endpoint") from None


def _check_method_url(obj: dict[str, Any], endpoint: str | None, extensions: bool) -> str | None:
    if obj.get("method", "POST" if extensions else None) != "POST":
        raise _Bad("method must be POST", "invalid_method", "method")
    url = obj.get("url")
    if url is None and extensions:
        return None  # a run line without a url goes to its queue's request_path_url
    if not isinstance(url, str) or url not in KNOWN_URLS:
        raise _Bad(f"url must be one of {', '.join(sorted(KNOWN_URLS))}", "invalid_url", "url")
    if endpoint is not None and url != endpoint:
        message = f"url {url} is not the batch's endpoint {endpoint}"
        raise _Bad(message, "mismatched_endpoint", "url")
    return url


def _body_text(body: Any, max_bytes: int, key: str) -> str:
    if not isinstance(body, dict):
        raise _Bad(f"{key} must be a JSON object", "invalid_body", key)
    try:
        text = orjson.dumps(body)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise _Bad(f"{key} is not JSON-serialisable: {exc}", "invalid_body", key) from None
    if len(text) > max_bytes:
        raise _Bad(f"{key} larger than {max_bytes} bytes", "line_too_large", key)
    return text.decode("utf-8")
