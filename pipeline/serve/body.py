"""The JSON object body of a POST (create a batch, cancel one): ``application/json`` only,
read as it arrives up to a limit (with or without ``Content-Length``), at most
:data:`MAX_DEPTH` levels deep. Every refusal is an OpenAI-shaped 4xx."""

from __future__ import annotations

import json
from typing import Any

from python_multipart.multipart import parse_options_header
from starlette.requests import Request

from .errors import ApiError, bad_request, body_too_large, unsupported_media_type

JSON_LIMIT = 1024 * 1024  # largest JSON request body, in bytes
MAX_DEPTH = 64  # most nested objects and arrays in one


async def json_object(request: Request, limit: int = JSON_LIMIT) -> dict[str, Any]:
    """The request's JSON object; ``{}`` when it has no body, with or without a JSON
    Content-Type (the OpenAI SDK's cancel sends ``application/json`` and no body, curl's
    ``-X POST`` neither)."""
    ctype = request.headers.get("content-type")
    if ctype is not None and not is_json(ctype):
        raise unsupported_media_type("application/json", ctype)
    raw = await read_body(request, limit)
    if not raw:
        return {}
    if ctype is None:
        raise unsupported_media_type("application/json", None)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise too_deep() from None
    except ValueError:  # also a body that is not UTF-8, and a number of over 4300 digits
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if depth_over(body, MAX_DEPTH):
        raise too_deep()
    return body


def is_json(ctype: str) -> bool:
    return parse_options_header(ctype)[0] == b"application/json"


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it passes ``limit`` bytes: at once when its
    ``Content-Length`` says so, else while it streams in (a chunked body has no length)."""
    length = request.headers.get("content-length")
    if length is not None and length.isascii() and length.isdigit() and int(length) > limit:
        raise body_too_large(limit)
    out = bytearray()
    async for chunk in request.stream():
        out += chunk
        if len(out) > limit:
            raise body_too_large(limit)
    return bytes(out)


def depth_over(value: Any, most: int) -> bool:
    """Whether objects and arrays nest more than ``most`` deep in ``value`` (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > most:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def too_deep() -> ApiError:
    return bad_request(f"the request body nests objects and arrays more than {MAX_DEPTH} deep")
