"""Input lines of a batch, checked one at a time: OpenAI Batch API lines, or with
``extensions`` the ``pipeline run`` forms (docs/batches.md). Every field is checked here for
presence, ``null`` and JSON type, so a bad line is a :class:`LineError` naming its field, never
an exception; its code and message are what the batch's ``errors`` or error file show."""

from __future__ import annotations

import math
import re
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
# what a line may hold besides its body (custom_id, url, a run line's own fields): a longer
# line is refused unread, so one line never costs more memory than this much over the body's
LINE_OVERHEAD = 64 * 1024
MAX_DEPTH = 1024  # nesting orjson parses (deeper: refused, naming the field)
MAX_TOKENS = 200_000  # strings and brackets looked at to name the field of a line refused unread
EXTENSIONS = ("priority", "deadline", "timeout", "metadata", "headers", "queue")
OPENAI_KEYS = frozenset({"custom_id", "method", "url", "body"})
RUN_KEYS = frozenset({"id", "payload", "endpoint"})
# a JSON string (escapes skipped; one left open runs to the end) or a bracket or colon: enough
# to find a line's top-level field at a byte offset without parsing it, in one pass (possessive:
# no byte is looked at twice, whatever the text)
_TOKEN = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)|[\[\]{}:]', re.DOTALL)


def max_line_bytes(max_body_bytes: int) -> int:
    """The longest line a batch reads (bytes, without its end of line)."""
    return max_body_bytes + LINE_OVERHEAD


@dataclass(frozen=True)
class Line:
    """A valid line: ``body`` as compact JSON text (the line's ``body_key`` field); ``extra``
    its run extensions, if any."""

    number: int
    custom_id: str
    url: str | None
    body: str
    model: str | None = None
    extra: dict[str, Any] | None = None
    body_key: str = "body"


@dataclass(frozen=True)
class LineError:
    """Why line ``number`` is not a request (with its custom_id when it could be read);
    ``param``: the field at fault, when one is."""

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
    limit = max_line_bytes(max_body_bytes)
    if len(raw) > limit:
        return _too_long(number, raw, limit, max_body_bytes)
    obj = _load(number, raw)
    if isinstance(obj, LineError):
        return obj
    if not isinstance(obj, dict):
        return LineError(number, "invalid_json_line",
                         f"line {number}: not a JSON object but {_kind(obj)}")  # fmt: skip
    run = extensions and _run_form(obj)
    id_key, body_key = ("id", "payload") if run else ("custom_id", "body")
    custom_id = obj.get("id", f"line-{number}") if run else obj.get("custom_id")
    cid = custom_id if isinstance(custom_id, str) and custom_id else None
    try:
        _check_custom_id(obj, id_key, custom_id)
        _check_known(obj, run, extensions)
        url = _run_endpoint(obj) if run else _check_method_url(obj, endpoint, extensions)
        body = _body_text(obj, body_key, max_body_bytes)
        extra = _extensions(obj) if extensions else {}
    except _Bad as bad:
        if bad.param == id_key:
            cid = None
        return LineError(number, bad.code, f"line {number}: {bad.message}", bad.param, cid)
    assert cid is not None
    model = obj[body_key].get("model")
    model = model if isinstance(model, str) else None
    return Line(number, cid, url, body, model, extra or None, body_key)


class _Bad(Exception):
    def __init__(self, message: str, code: str, param: str) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


def _kind(value: Any) -> str:
    """A JSON value's type, for a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _load(number: int, raw: bytes) -> Any:
    """The line's JSON value, or the LineError saying why it has none (naming the field where
    the text is not UTF-8 or nests too deep)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        reason = str(exc)
    if reason.startswith("str is not valid UTF-8"):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            field = _field_at(raw, offset=bad.start)
            where = f"{field} is not" if field else "it is not"
            message = f"line {number}: not UTF-8 ({where} UTF-8 text at byte {bad.start})"
            return LineError(number, "invalid_json_line", message, field)
    if reason.startswith(("depth limit exceeded", "recursion limit")):
        field = _field_at(raw, depth=MAX_DEPTH)
        what = field or "the line"
        message = f"line {number}: {what} is nested deeper than {MAX_DEPTH} levels"
        return LineError(number, "invalid_json_line", message, field)
    return LineError(number, "invalid_json_line", f"line {number}: not JSON: {reason}")


def _too_long(number: int, raw: bytes, limit: int, max_body_bytes: int) -> LineError:
    field = _field_at(raw, offset=limit)
    what = f"its {field} is" if field else "it is"
    message = (
        f"line {number}: longer than {limit} bytes ({what} too large; a body may have at most "
        f"{max_body_bytes} bytes)"
    )
    return LineError(number, "line_too_large", message, field)


def _field_at(raw: bytes, *, offset: int | None = None, depth: int | None = None) -> str | None:
    """The top-level field of a JSON object line whose value holds byte ``offset``, or in which
    nesting first passes ``depth`` levels (best effort: None when the text does not say)."""
    level, key, last = 0, None, b""
    for n, m in enumerate(_TOKEN.finditer(raw)):
        if n >= MAX_TOKENS:
            return None  # a bound on the work a bad line costs
        if offset is not None and m.start() >= offset:
            break
        tok = m.group()
        if tok[0] == 0x22:  # a string: a key if a colon follows it at level 1
            last = tok
        elif tok == b":":
            if level == 1:
                key = last
        elif tok in (b"{", b"["):
            level += 1
            if depth is not None and level > depth:
                break
        else:
            level -= 1
    else:
        if offset is None:
            return None  # the nesting never went that deep
    if key is None or level < 1:
        return None
    try:
        name = orjson.loads(key)
    except orjson.JSONDecodeError:
        name = key[1:-1].decode("utf-8", "replace")
    return name if isinstance(name, str) else None


def _run_form(obj: dict[str, Any]) -> bool:
    """A line of ``submit`` arguments (``id``, ``payload``, ``endpoint``) rather than an
    OpenAI line: it has a payload and no body, or an id or endpoint and neither body nor
    custom_id."""
    if "body" in obj:
        return False
    return "payload" in obj or ("custom_id" not in obj and ("id" in obj or "endpoint" in obj))


def _check_custom_id(obj: dict[str, Any], key: str, custom_id: Any) -> None:
    if key not in obj and key == "custom_id":
        raise _Bad(f"missing {key}: each line needs one, unique in the batch",
                   "missing_required_parameter", key)  # fmt: skip
    if not isinstance(custom_id, str) or not custom_id:
        got = "null" if custom_id is None else _kind(custom_id) if custom_id != "" else "empty"
        message = f"{key} must be a non-empty string, not {got}"
        raise _Bad(message, "invalid_custom_id", key)
    if len(custom_id) > MAX_CUSTOM_ID:
        raise _Bad(f"{key} longer than {MAX_CUSTOM_ID} characters", "invalid_custom_id", key)


def _check_known(obj: dict[str, Any], run: bool, extensions: bool) -> None:
    known = RUN_KEYS if run else OPENAI_KEYS
    unknown = sorted(set(obj) - known - (set(EXTENSIONS) if extensions else set()))
    if unknown:
        fields = ", ".join(sorted(known)) + (", " + ", ".join(EXTENSIONS) if extensions else "")
        message = f"unknown field {unknown[0]!r} (a line's fields: {fields})"
        raise _Bad(message, "invalid_request", unknown[0])


def _run_endpoint(obj: dict[str, Any]) -> str | None:
    if "endpoint" not in obj:
        return None  # its queue's request_path_url
    value = obj["endpoint"]
    if not isinstance(value, str):
        raise _Bad(f"endpoint must be a URL path starting with '/', not {_kind(value)}",
                   "invalid_url", "endpoint")  # fmt: skip
    try:
        return check_endpoint(value) or None
    except InvalidRequest as exc:
        raise _Bad(str(exc), "invalid_url", "endpoint") from None


def _check_method_url(obj: dict[str, Any], endpoint: str | None, extensions: bool) -> str | None:
    if "method" not in obj and not extensions:
        raise _Bad("missing method: it must be POST", "missing_required_parameter", "method")
    method = obj.get("method", "POST")
    if method != "POST":
        got = repr(method) if isinstance(method, str) else _kind(method)
        raise _Bad(f"method must be POST, not {got}", "invalid_method", "method")
    if "url" not in obj:
        if extensions:
            return None  # a run line without a url goes to its queue's request_path_url
        raise _Bad("missing url: the endpoint this line is sent to",
                   "missing_required_parameter", "url")  # fmt: skip
    url = obj["url"]
    if not isinstance(url, str) or url not in KNOWN_URLS:
        got = repr(url) if isinstance(url, str) else _kind(url)
        message = f"url must be one of {', '.join(sorted(KNOWN_URLS))}, not {got}"
        raise _Bad(message, "invalid_url", "url")
    if endpoint is not None and url != endpoint:
        message = f"url {url} is not the batch's endpoint {endpoint}"
        raise _Bad(message, "mismatched_endpoint", "url")
    return url


def _body_text(obj: dict[str, Any], key: str, max_bytes: int) -> str:
    if key not in obj:
        raise _Bad(f"missing {key}: the request's JSON body, an object",
                   "missing_required_parameter", key)  # fmt: skip
    body = obj[key]
    if not isinstance(body, dict):
        raise _Bad(f"{key} must be a JSON object, not {_kind(body)}", "invalid_body", key)
    try:
        text = orjson.dumps(body)
    except (TypeError, orjson.JSONEncodeError) as exc:
        reason = "nested too deeply" if "ecursion" in str(exc) else str(exc)
        raise _Bad(f"{key} cannot be sent as JSON: {reason}", "invalid_body", key) from None
    if len(text) > max_bytes:
        raise _Bad(f"{key} larger than {max_bytes} bytes", "line_too_large", key)
    return text.decode("utf-8")


def _extensions(obj: dict[str, Any]) -> dict[str, Any]:
    """The run fields the line gives, each of the JSON type it must have (their values are
    checked further as ``submit`` checks its arguments: pipeline/batch/ingest.py)."""
    out = {k: obj[k] for k in EXTENSIONS if k in obj}
    for name, value in out.items():
        problem = _extension_problem(name, value)
        if problem:
            raise _Bad(f"{name} {problem}", "invalid_request", name)
    if "deadline" in out and "timeout" in out:
        raise _Bad("deadline and timeout both given: give one", "invalid_request", "deadline")
    return out


def _extension_problem(name: str, value: Any) -> str | None:
    if value is None:
        return "is null: leave it out, or give a value"
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if name == "priority" and not (number and isinstance(value, int) and 0 <= value <= 9):
        return f"must be an integer from 0 to 9, not {_show(value)}"
    if name == "deadline" and not (number and math.isfinite(value)):
        return f"must be a Unix time in seconds, not {_show(value)}"
    if name == "timeout" and not (number and math.isfinite(value) and value > 0):
        return f"must be a positive number of seconds, not {_show(value)}"
    if name == "queue" and not (isinstance(value, str) and value):
        return f"must be a queue's name, not {_show(value)}"
    if name in ("metadata", "headers"):
        if not isinstance(value, dict):
            return f"must be an object of strings, not {_kind(value)}"
        bad = next((k for k, v in value.items() if not isinstance(v, str)), None)
        if bad is not None:
            return f"must be an object of strings ({bad!r} is {_kind(value[bad])})"
    return None


def _show(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40])
    return _kind(value)
