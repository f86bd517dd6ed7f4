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
    if extensions and "payload" in obj and "body" not in obj:
        return _run_line(number, obj, max_body_bytes)
    custom_id = obj.get("custom_id")
    cid = custom_id if isinstance(custom_id, str) else None
    extra = {k: obj[k] for k in EXTENSIONS if k in obj} if extensions else None
    unknown = set(obj) - OPENAI_KEYS - (EXTENSIONS if extensions else set())
    problem = _check_custom_id(custom_id)
    if problem is None and unknown:
        name = sorted(unknown)[0]
        problem = (f"unknown field {name!r}", "invalid_request", name)
    if problem is None:
        problem = _check_method_url(obj, endpoint, extensions)
    if problem is not None:
        message, code, param = problem
        return LineError(number, code, f"line {number}: {message}", param, cid)
    body = _body_text(obj.get("body"), max_body_bytes)
    if isinstance(body, tuple):
        message, code = body
        return LineError(number, code, f"line {number}: {message}", "body", cid)
    assert cid is not None
    model = obj["body"].get("model")
    return Line(
        number,
        cid,
        obj.get("url"),
        body,
        model if isinstance(model, str) else None,
        extra or None,
    )


def _run_line(number: int, obj: dict[str, Any], max_body_bytes: int) -> Line | LineError:
    """A line of submit arguments: ``payload``, ``id`` (the custom_id; absent: ``line-<n>``)."""
    rid = obj.get("id", f"line-{number}")
    problem = _check_custom_id(rid)
    if problem is not None:
        message, code, _ = problem
        return LineError(number, code, f"line {number}: {message.replace('custom_id', 'id')}", "id")
    unknown = set(obj) - EXTENSIONS - {"payload", "id", "endpoint"}
    if unknown:
        name = sorted(unknown)[0]
        return LineError(
            number, "invalid_request", f"line {number}: unknown field {name!r}", name, rid
        )
    try:
        endpoint = check_endpoint(obj.get("endpoint")) or None
    except InvalidRequest as exc:
        return LineError(number, "invalid_url", f"line {number}: {exc}", "endpoint", rid)
    body = _body_text(obj["payload"], max_body_bytes)
    if isinstance(body, tuple):
        message, code = body
        return LineError(
            number, code, f"line {number}: {message.replace('body', 'payload')}", "payload", rid
        )
    extra = {k: obj[k] for k in EXTENSIONS if k in obj}
    model = obj["payload"].get("model")
    return Line(
        number, rid, endpoint, body, model if isinstance(model, str) else None, extra or None
    )


def _check_custom_id(custom_id: Any) -> tuple[str, str, str] | None:
    if custom_id is None:
        return "missing custom_id", "missing_required_parameter", "custom_id"
    if not isinstance(custom_id, str) or not custom_id:
        return "custom_id must be a non-empty string", "invalid_custom_id", "custom_id"
    if len(custom_id) > MAX_CUSTOM_ID:
        return f"custom_id longer than {MAX_CUSTOM_ID} characters", "invalid_custom_id", "custom_id"
    return None


def _check_method_url(
    obj: dict[str, Any], endpoint: str | None, extensions: bool
) -> tuple[str, str, str] | None:
    method = obj.get("method", "POST" if extensions else None)
    if method != "POST":
        return "method must be POST", "invalid_method", "method"
    url = obj.get("url")
    if url is None and extensions:
        return None  # a run line without a url goes to its queue's request_path_url
    if not isinstance(url, str) or url not in KNOWN_URLS:
        known = ", ".join(sorted(KNOWN_URLS))
        return f"url must be one of {known}", "invalid_url", "url"
    if endpoint is not None and url != endpoint:
        return f"url {url} is not the batch's endpoint {endpoint}", "mismatched_endpoint", "url"
    return None


def _body_text(body: Any, max_bytes: int) -> str | tuple[str, str]:
    """The body as compact JSON text, or (message, code)."""
    if not isinstance(body, dict):
        return "body must be a JSON object", "invalid_body"
    try:
        text = orjson.dumps(body)
    except (TypeError, orjson.JSONEncodeError) as exc:
        return f"body is not JSON-serialisable: {exc}", "invalid_body"
    if len(text) > max_bytes:
        return f"body larger than {max_bytes} bytes", "line_too_large"
    return text.decode("utf-8")
